"""Every file the README links to or shows ships with the repository."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Markdown links and images whose target is a path in this repository (no scheme, no anchor only).
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _local_targets() -> list[str]:
    targets = LINK.findall((ROOT / "README.md").read_text())
    return sorted({t for t in targets if "://" not in t and not t.startswith("mailto:")})


def test_readme_links_point_at_files_that_exist() -> None:
    targets = _local_targets()
    assert targets, "the README links to no file of its own: the pattern above no longer matches"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs a git checkout")
def test_readme_links_are_not_git_ignored() -> None:
    """A linked file that .gitignore hides exists here and is missing from every clean checkout."""
    proc = subprocess.run(["git", "check-ignore", *_local_targets()], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, f"README links to git-ignored files: {proc.stdout.split()}"


def test_the_readme_api_taste_runs_as_written() -> None:
    """The README's Python example, run as printed (under a name of this session)."""
    from tests.conftest import new_name

    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start:text.index("```", start)]
    assert '"frontend-0"' in code, "the example's segment name changed: update this test"
    scope: dict[str, object] = {}
    exec(compile(code.replace('"frontend-0"', repr(new_name("readme"))), "README.md", "exec"), scope)
    assert scope["total"] == 3 * 336 * 336
    assert scope["owned"]["pixel_values"].shape == (3, 336, 336)  # type: ignore[index]
    assert scope["writer"].closed and scope["reader"].closed  # type: ignore[attr-defined]

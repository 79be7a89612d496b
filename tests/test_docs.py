"""Every code block of the README, CONTRIBUTING and docs/ runs, or is checked, as printed.

- `python` blocks run as a file of their own (a block titled `title="x.py"` under that name),
  each in a fresh interpreter in an empty folder, and must exit 0 within a minute and leave
  /dev/shm as they found it.
- `sh` blocks are split into commands. `shmstore ...` commands run for real where they only
  read or write files of their own (keygen, hitrate on a small trace in the empty folder), and
  otherwise go through the real command-line parser; `scripts/*.sh` must exist and be
  executable; `pip install` may only name extras the package has and the vLLM versions the
  tests ran; `vllm serve` flags must be flags of the installed vLLM's parser; a pytest command
  must collect tests, and a marker selection must leave some out. A `python` block's
  `# prints: TEXT` lines must be in what it prints. A command no rule knows
  fails the test, so a new kind of command needs a rule here.
- `text` blocks are output or drawings, `yaml` blocks must parse, and any other language fails.

Blocks are found with markdown-it-py, the parser pytest-markdown-docs uses; the blocks are run
here rather than through that plugin because they must run in separate processes (several
start their own readers with the spawn start method).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from markdown_it import MarkdownIt

from shmstore.cli._commands import build_parser
from tests import _shm as _shm_entries

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md",
         *sorted((ROOT / "docs").rglob("*.md"))]
TITLE = re.compile(r'title="([^"]+)"')
PRINTS = re.compile(r"^# prints: (.+)$", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    title: str | None
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    parser = MarkdownIt("commonmark")
    found = []
    for page in PAGES:
        for token in parser.parse(page.read_text()):
            if token.type != "fence" or token.map is None:
                continue
            info = token.info.strip()
            if info.startswith("{"):  # superfences: {.python title="x.py"}
                lang = next((w[1:] for w in info.strip("{}").split() if w.startswith(".")), "")
            else:
                lang = info.split()[0] if info else ""
            title = TITLE.search(info)
            found.append(Block(page, token.map[0] + 1, lang, title.group(1) if title else None,
                               token.content))
    return found


BLOCKS = _blocks()


def _of(*langs: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang in langs]


def test_every_block_has_a_language_this_test_knows() -> None:
    unknown = [f"{b.id} ({b.lang or 'no language'})" for b in BLOCKS
               if b.lang not in ("python", "sh", "text", "yaml")]
    assert not unknown, f"blocks no rule runs or checks: {unknown}; write python, sh, text or yaml"
    assert len(_of("python")) >= 6 and len(_of("sh")) >= 8, "the pages lost their blocks?"


def _shm() -> set[str]:
    return _shm_entries.entries()


def _run_python(path: Path, cwd: Path) -> None:
    before = _shm()
    proc = subprocess.run([sys.executable, path.name], cwd=cwd, capture_output=True, text=True,
                          timeout=90, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout}\n{proc.stderr}"
    for said in PRINTS.findall(path.read_text()):  # what the block says it prints, it prints
        assert said.strip() in proc.stdout, f"{path.name} should print {said!r}:\n{proc.stdout}"
    left = _shm_entries.left_since(before)
    assert not left, f"{path.name} left {left} in /dev/shm"


@pytest.mark.slow
@pytest.mark.alone  # what the block left in /dev/shm: see pyproject.toml
@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", _of("python"), ids=lambda b: b.id)
def test_python_block_runs_as_printed(block: Block, tmp_path: Path) -> None:
    path = tmp_path / (block.title or "snippet.py")
    path.write_text(block.code)
    _run_python(path, tmp_path)


def _prompt_errors(code: str) -> list[str]:
    """What Python's interactive prompt says pasting `code` line by line (it reads statements
    as the REPL does, runs nothing): a block whose indented lines are followed by an
    unindented one without a blank line between is a SyntaxError there."""
    import codeop

    compile_line = codeop.CommandCompiler()
    errors, buffer = [], []
    for number, line in enumerate(code.splitlines() + [""], 1):
        buffer.append(line)
        try:
            done = compile_line("\n".join(buffer), "<stdin>", "single")
        except (SyntaxError, ValueError, OverflowError) as exc:
            errors.append(f"line {number}: {exc}")
            buffer = []
            continue
        if done is not None:
            buffer = []
    return errors


@pytest.mark.parametrize("block", [b for b in _of("python") if b.title is None],
                         ids=lambda b: b.id)
def test_python_block_pastes_into_the_prompt(block: Block) -> None:
    """Blocks without a file name are for pasting into `python`; a titled block is a file."""
    assert not _prompt_errors(block.code), _prompt_errors(block.code)


@pytest.mark.parametrize("block", _of("yaml"), ids=lambda b: b.id)
def test_yaml_block_parses(block: Block) -> None:
    assert yaml.safe_load(block.code) is not None


# -- shell blocks ----------------------------------------------------------------------------------

def _commands(code: str) -> list[list[str]]:
    """The block's commands as argv lists: comments dropped, continuation lines joined,
    leading VAR=value assignments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words:  # `a && b` is two commands
            cut = words.index("&&") if "&&" in words else len(words)
            command, words = words[:cut], words[cut + 1:]
            while command and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", command[0]):
                command = command[1:]
            if command:
                commands.append(command)
    return commands


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([a-z0-9-]+) = ", section, re.M))


def _check_pip(argv: list[str]) -> None:
    assert argv[:2] == ["pip", "install"], argv
    extras = _extras()
    for arg in argv[2:]:
        if arg.startswith("-"):
            continue
        named = re.fullmatch(r"\.\[([a-z0-9,-]+)\]", arg)
        if named:
            unknown = set(named.group(1).split(",")) - extras
            assert not unknown, f"pip install names extras the package lacks: {unknown}"
            continue
        assert arg == ".", f"pip install {arg!r}: install shmstore from its checkout ('.' or '.[extra]')"


def _check_shmstore(argv: list[str], cwd: Path) -> None:
    args = build_parser().parse_args(argv[1:])  # exits 2 (SystemExit) on a bad option
    if args.command == "relay" and args.relay_command == "keygen":
        subprocess.run([sys.executable, "-m", "shmstore", *argv[1:]], cwd=cwd, check=True,
                       capture_output=True, timeout=60)
    elif args.command == "hitrate":
        trace = cwd / args.trace
        if not trace.exists():  # a small trace of the documented csv layout
            rows = [f"{t},img-{(t * 7919) % 97},{(1 + t % 5) << 20}" for t in range(600)]
            trace.write_text("time,key,bytes\n" + "\n".join(rows) + "\n")
        proc = subprocess.run([sys.executable, "-m", "shmstore", *argv[1:], "--no-progress"],
                              cwd=cwd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "recommended:" in proc.stdout


def _check_pytest(argv: list[str]) -> None:
    """Collects what the command selects: at least one test, and for a marker selection (`-m`,
    the inner loop) some tests left out as well (the docs give lanes no counts: they would go
    stale with every test added)."""
    returncode, stdout = _collected(tuple(argv[3:]))
    assert returncode == 0, stdout[-2000:]
    if "-m" not in argv[3:]:  # not a marker selection: any test collected will do
        return
    selected = re.search(r"(\d+)/(\d+) tests collected", stdout)
    assert selected, stdout[-2000:]
    assert 0 < int(selected.group(1)) < int(selected.group(2)), stdout[-2000:]


@functools.cache
def _collected(args: tuple[str, ...]) -> tuple[int, str]:
    """pytest's collection of `args` (once per run: the README and CONTRIBUTING print the same
    lane)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout


@functools.cache
def _vllm_serve_flags() -> frozenset[str]:
    from shmstore.vllm._vllm import serve_parser  # the door to vLLM's own parser

    return frozenset(s for action in serve_parser()._actions for s in action.option_strings)


def _check_vllm_serve(argv: list[str]) -> None:
    pytest.importorskip("vllm")
    known = _vllm_serve_flags()
    flags = {a.split("=")[0] for a in argv if a.startswith("--")}
    assert flags <= known, f"flags vLLM's serve does not know: {flags - known}"


def _check_command(argv: list[str], cwd: Path) -> None:
    program = argv[0]
    if argv[:2] == ["shmstore", "serve"]:
        _check_vllm_serve(argv)
    elif program in ("shmstore", "python") and argv[:3] != ["python", "-m", "pytest"]:
        _check_shmstore(argv if program == "shmstore" else argv[2:], cwd)
    elif program.startswith("scripts/"):
        script = ROOT / program
        assert script.is_file() and os.access(script, os.X_OK), f"{program} is not an executable"
    elif program == "pip":
        _check_pip(argv)
    elif program == "vllm" and argv[1] == "serve":
        _check_vllm_serve(argv)
    elif argv[:3] == [".venv/bin/python", "-m", "pytest"] or argv[:3] == ["python", "-m", "pytest"]:
        _check_pytest(argv)
    elif argv[0] == ".venv/bin/python" and argv[1].startswith("bench/"):
        assert (ROOT / argv[1]).is_file(), f"{argv[1]} does not exist"
    elif program == "git":
        repo = re.search(r"^repo_url: (\S+)", (ROOT / "mkdocs.yml").read_text(), re.M)
        assert repo and argv == ["git", "clone", repo.group(1)], (
            f"{shlex.join(argv)}: clone the project's repository ({repo and repo.group(1)})")
    elif program == "cd":
        assert argv == ["cd", "shmstore"], "only into the clone"
    elif program == "docker":
        assert "--shm-size" in " ".join(argv), "a docker command here is about /dev/shm's size"
    else:
        pytest.fail(f"no rule checks the command {shlex.join(argv)!r}: add one to tests/test_docs.py")


@pytest.mark.slow
@pytest.mark.alone  # what the block left in /dev/shm: see pyproject.toml
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", _of("sh"), ids=lambda b: b.id)
def test_shell_block_runs_or_parses_as_printed(block: Block, tmp_path: Path) -> None:
    before = _shm()
    commands = _commands(block.code)
    assert commands, f"{block.id}: an sh block without a command"
    for argv in commands:
        _check_command(argv, tmp_path)
    assert not _shm_entries.left_since(before)

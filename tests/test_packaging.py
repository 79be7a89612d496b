"""A plain `pip install` works with or without a C compiler: the one compiled module
(_native/_atomic.c) is optional, and the pure-Python ordering takes over without it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def build_wheel(out: Path, env: dict[str, str]) -> Path:
    """Build from a clean copy of the sources: no module compiled in place, no build/ cache."""
    src = out / "src"
    shutil.copytree(ROOT / "shmstore", src / "shmstore",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--wheel-dir", str(out), str(src)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = out.glob("shmstore-*.whl")
    return wheel


@pytest.mark.slow
def test_a_machine_without_a_c_compiler_still_builds_a_working_wheel(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path, {"CC": "false", "CXX": "false"})  # every compile fails
    names = zipfile.ZipFile(wheel).namelist()
    assert "shmstore/shm/_ordering.py" in names and "shmstore/__init__.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyd"))], names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import shmstore, shmstore.shm._ordering as o\n"
            "q = shmstore.BroadcastQueue.create(None, n_readers=1)\n"
            "r = shmstore.BroadcastQueue.attach(q.name, 0)\n"
            "q.put({'x': 1}); assert r.get(timeout=5) == {'x': 1}; r.close(); q.close()\n"
            "print(o.ORDERING, shmstore.__file__)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("SHMSTORE_ORDERING", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    ordering, where = out.stdout.split()
    assert where.startswith(str(site)), where  # the wheel's copy, not the checkout's
    assert ordering in ("plain", "libatomic")

"""The demo end to end for every cache kind, its pieces, and clean-up on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from shmstore.cache._caches import CACHE_KINDS
from shmstore.cli._demo import CLIP_MEAN, CLIP_STD, CROP, n_tiles, preprocess_numpy, request_stream
from tests import _shm
from tests._waiting import wait_for

pytestmark = pytest.mark.alone  # what a command left in /dev/shm: see pyproject.toml

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_demo_end_to_end(kind: str) -> None:
    before = _shm.entries()
    out = subprocess.run(
        [sys.executable, "-m", "shmstore", "demo", "--cache", kind, "--requests", "40",
         "--images", "12", "--cache-gb", "0.03", "--no-progress"],
        capture_output=True, text=True, timeout=140, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verification                 OK: worker 0 40/40, worker 1 40/40" in out.stdout
    assert "hit ratio" in out.stdout and "requests/s" in out.stdout
    last = out.stdout.strip().splitlines()[-1]
    other = "shmstore's shm-adaptive" if kind == "lru" else "vLLM's default, a mirrored LRU"
    assert last.startswith(f"result: every tensor verified; {kind}: ") and other in last, last
    assert not _shm.left_since(before)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_result_line_matches_a_real_lru_run() -> None:
    """The shm run's replayed mirrored-LRU bytes by value equal what a real lru run sends."""
    args = ["--requests", "60", "--images", "15", "--cache-gb", "0.03", "--no-progress"]
    runs = {kind: subprocess.run([sys.executable, "-m", "shmstore", "demo", "--cache", kind, *args],
                                 capture_output=True, text=True, timeout=140, env=ENV)
            for kind in ("shm-adaptive", "lru")}
    for run in runs.values():
        assert run.returncode == 0, run.stdout + run.stderr
    replayed = re.search(r"replayed on these requests: (\d+) MB", runs["shm-adaptive"].stdout)
    real = re.search(r"result: every tensor verified; lru: (\d+) MB sent by value",
                     runs["lru"].stdout)
    assert replayed and real and replayed.group(1) == real.group(1), (replayed, real)


def test_without_its_extra_the_demo_gives_one_line(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    from shmstore.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "PIL" else real(name, *a))
    assert main(["demo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["shmstore demo needs Pillow: pip install '.[demo]' in the checkout, or run "
                   "scripts/demo.sh, which installs it"]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_cleans_up_when_interrupted(sig: signal.Signals) -> None:
    before = _shm.entries()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmstore", "demo", "--requests", "100000", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not _shm.made_by(proc.pid, before):
        time.sleep(0.1)
    time.sleep(2)  # workers attached, requests flowing
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err  # as a shell reports it: SIGTERM was once 130
    assert "cleaned up" in err
    wait_for(lambda: not _shm.left_since(before), 30, "the demo's segments to be gone")


def test_preprocess_matches_clip_normalisation() -> None:
    gray = Image.new("RGB", (500, 400), (128, 128, 128))
    pixels = preprocess_numpy(gray)
    assert pixels.dtype == np.float32 and pixels.shape == (n_tiles(gray), 3, CROP, CROP)
    expected = (128 / 255 - CLIP_MEAN) / CLIP_STD
    assert np.allclose(pixels[0, :, 100, 100], expected, atol=1e-5)


def test_tiles_grow_with_the_image() -> None:
    assert n_tiles(Image.new("RGB", (336, 336))) == 1
    assert n_tiles(Image.new("RGB", (1400, 1000))) == 5


def test_request_stream_is_reproducible_and_recurring() -> None:
    a, b = request_stream(300, 50, seed=3), request_stream(300, 50, seed=3)
    assert a == b and len(a) == 300
    assert len(set(a)) < 200  # images recur
    assert any(i >= 50 for i in a)  # and some are seen once

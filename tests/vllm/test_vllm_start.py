"""Starting `shmstore serve` on the CPU build: the vLLM guide's CPU line starts as printed (its
8 GiB store, its KV cache setting and 2 API servers on this 24 GiB machine), and a start that
fails leaves nothing in /dev/shm: vLLM's own CPU memory check refuses the KV cache after API
server 0 has created the store, and vLLM kills its API server processes (SIGKILL to the process
tree, no exit handler runs); the store's tracker removes the segment. Before the tracker, each
failed start left a dead writer's 4 GiB segment, and retries piled them up under new names."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from tests._shm import wait_removed
from tests._waiting import wait_for
from tests.conftest import new_name
from tests.vllm.tiny_llava import build

pytestmark = [pytest.mark.timeout(600), pytest.mark.serving]
SHMSTORE = Path(sys.executable).with_name("shmstore")
GUIDE = Path(__file__).parents[2] / "docs" / "vllm.md"
README = Path(__file__).parents[2] / "README.md"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_guides_cpu_line_starts_a_server_as_printed(tmp_path: Path) -> None:
    """The guide's and the README's CPU line (the same line), on a model made as the README
    says to try it: `shmstore tiny-model DIR`."""
    line = next(line for line in GUIDE.read_text().splitlines()
                if "shmstore serve MODEL" in line and "VLLM_CPU_KVCACHE_SPACE" in line)
    assert line.strip() in README.read_text().splitlines(), "the README prints another line"
    words = shlex.split(line)
    env_words = [w for w in words[:words.index("shmstore")] if "=" in w]
    argv = words[words.index("shmstore") + 1:]
    made = subprocess.run([str(SHMSTORE), "tiny-model", str(tmp_path / "model")],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    assert "shmstore serve " in made.stdout  # it says how to serve it
    model = tmp_path / "model"
    segment = new_name("guide")
    port = free_port()
    env = {**{k: v for k, v in os.environ.items()
              if k not in ("LOCAL_RANK", "VLLM_CPU_KVCACHE_SPACE")},
           **dict(w.split("=", 1) for w in env_words),
           "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": segment, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).parents[2])}
    # as printed, with the test's model, a local port, and no graph compile
    argv = [str(model) if w == "MODEL" else w for w in argv]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager"]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(SHMSTORE), *argv], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()[-5000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    return True
            except OSError:
                return False

        wait_for(healthy, 400, "the server to start")
        text = log.read_text()
        assert f"segment '{segment}', {8 << 30} bytes" in text
        assert "2 API server(s)" in text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    wait_removed(segment, 60, log.read_text()[-5000:])


def test_a_start_refused_by_vllms_memory_check_leaves_no_segment(tmp_path: Path) -> None:
    model = build(tmp_path / "model")
    segment = new_name("failed-start")
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "LOCAL_RANK"},
           "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": segment, "OMP_NUM_THREADS": "1",
           "VLLM_CPU_KVCACHE_SPACE": "100000",  # GiB: more than any machine has
           "PYTHONPATH": str(Path(__file__).parents[2])}
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(SHMSTORE), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
             "--mm-processor-cache-type", "shm", "--mm-processor-cache-gb", "0.25",
             "--max-model-len", "256", "--enforce-eager", "--api-server-count", "2"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        returncode = proc.wait(480)
    finally:  # interrupted or timed out: the launcher's API servers are its group's too
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    text = log.read_text()
    assert returncode != 0, text[-3000:]
    assert f"segment '{segment}'" in text, text[-3000:]  # the store was made before the check
    assert "less than requested memory for kv" in text, text[-3000:]
    wait_removed(segment, 60, log.read_text()[-5000:])

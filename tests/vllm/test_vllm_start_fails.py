"""A `shmstore serve` whose start fails leaves nothing in /dev/shm: vLLM's own CPU memory check
refuses the KV cache after API server 0 has created the store, and vLLM kills its API server
processes (SIGKILL to the process tree, no exit handler runs); the store's tracker removes the
segment. Before the tracker, each failed start left a dead writer's 4 GiB segment, and retries
piled them up under new names."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from tests._waiting import wait_for
from tests.conftest import new_name
from tests.vllm.tiny_llava import build

pytestmark = [pytest.mark.timeout(600), pytest.mark.serving]
SHMSTORE = Path(sys.executable).with_name("shmstore")


def test_a_start_refused_by_vllms_memory_check_leaves_no_segment(tmp_path: Path) -> None:
    model = build(tmp_path / "model")
    segment = new_name("failed-start")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**{k: v for k, v in os.environ.items() if k != "LOCAL_RANK"},
           "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": segment, "OMP_NUM_THREADS": "1",
           "VLLM_CPU_KVCACHE_SPACE": "100000",  # GiB: more than any machine has
           "PYTHONPATH": str(Path(__file__).parents[2])}
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        done = subprocess.run(
            [str(SHMSTORE), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
             "--mm-processor-cache-type", "shm", "--mm-processor-cache-gb", "0.25",
             "--max-model-len", "256", "--enforce-eager", "--api-server-count", "2"],
            stdout=out, stderr=subprocess.STDOUT, env=env, timeout=480,
            start_new_session=True)
    text = log.read_text()
    assert done.returncode != 0, text[-3000:]
    assert f"segment '{segment}'" in text, text[-3000:]  # the store was made before the check
    assert "less than requested memory for kv" in text, text[-3000:]
    wait_for(lambda: not any(p.startswith(segment) for p in os.listdir("/dev/shm")), 60,
             f"{segment} to be removed")

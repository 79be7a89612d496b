"""End to end: a real vLLM engine (CPU build) on a tiny LLaVA model, with shmstore serving its
`shm` multimodal processor cache at tensor-parallel size 1 and 2.

Each engine runs in its own process (tests/vllm_engine_run.py): greedy outputs must equal those
of vLLM's own `lru` cache, shmstore's store must have served every image (stored once, hits
counted, every TP rank attached and done with every hand-out), and nothing may be left in
/dev/shm once the engine has exited. About 30 s per engine start on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from tests.conftest import new_name
from tests.tiny_llava import build

pytestmark = pytest.mark.timeout(600)
RUNNER = Path(__file__).with_name("vllm_engine_run.py")


def run_engine(model: Path, cache_type: str, tp: int, segment: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env = {**env, "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": segment,
           "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(RUNNER.parent.parent)}
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    done = subprocess.run([sys.executable, str(RUNNER), str(model), cache_type, str(tp)],
                          capture_output=True, text=True, timeout=540, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, (done.stdout[-3000:], done.stderr[-6000:])
    report: dict[str, Any] = json.loads(lines[-1][len("REPORT "):])
    report["log"] = done.stdout + done.stderr
    return report


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def lru_tokens(model: Path) -> list[list[int]]:
    report = run_engine(model, "lru", 1, new_name("lru"))
    assert report["cache_class"] == "LruKeyReplicatedSenderCache"
    return report["tokens"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("tp", [1, 2])
def test_shmstore_serves_vllms_shm_cache_with_identical_outputs(
        model: Path, lru_tokens: list[list[int]], tp: int) -> None:
    segment = new_name(f"vllm-tp{tp}")
    report = run_engine(model, "shm", tp, segment)
    assert report["cache_class"] == "ShmstoreSenderCache"
    assert f"shmstore serves vLLM's shm multimodal cache: segment {segment!r}" in report["log"]
    assert report["tokens"] == lru_tokens  # greedy: the same tokens as vLLM's own cache
    assert len({tuple(t) for t in lru_tokens}) == 3  # the images matter to the outputs
    # 3 images, each sent twice: stored once, then a hit; every rank read every hand-out
    assert (report["puts"], report["hits"]) == (3, 3)
    assert (report["vllm_hits"], report["vllm_total"]) == (3, 6)
    assert report["n_readers"] == tp and report["reader_lag"] == [0] * tp
    assert report["corrupt_reads"] == [0] * tp
    pids = report["reader_pids"]
    assert all(pids) and len(set(pids)) == tp  # each TP rank attached as its own reader
    assert not Path("/dev/shm", segment).exists()  # the engine's exit unlinked it

"""End to end: a real vLLM engine (CPU build) on a tiny LLaVA model, with shmstore serving its
`shm` multimodal processor cache at tensor-parallel size 1 and 2.

Each engine runs in its own process (tests/vllm/vllm_engine_run.py): greedy outputs must equal those
of vLLM's own `lru` cache, shmstore's store must have served every image (stored once, hits
counted, every TP rank attached and done with every hand-out), and nothing may be left in
/dev/shm once the engine has exited. About 30 s per engine start on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from tests.conftest import new_name
from tests.vllm.tiny_llava import build

pytestmark = [pytest.mark.timeout(600), pytest.mark.serving]
RUNNER = Path(__file__).with_name("vllm_engine_run.py")
REQUESTS_RUNNER = Path(__file__).with_name("vllm_requests_run.py")


def engine_env(segment: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    return {**env, "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": segment,
            "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(RUNNER.parents[2]), **extra}


def run_engine(model: Path, cache_type: str, tp: int, segment: str, *nodes: int,
               runner: Path = RUNNER, **extra: str) -> dict[str, Any]:
    env = engine_env(segment, **extra)
    if tp == 2 and not nodes:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    args = [cache_type] if runner == RUNNER else []
    done = subprocess.run([sys.executable, str(runner), str(model), *args, str(tp),
                           *map(str, nodes)], capture_output=True, text=True, timeout=540, env=env)
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


def served_identically(report: dict[str, Any], log: str, segment: str,
                       lru_tokens: list[list[int]], tp: int) -> None:
    """The six standard prompts (tests/vllm/vllm_engine_run.py) on a fresh engine at `tp`."""
    assert report["cache_class"] == "ShmstoreSenderCache"
    assert f"shmstore serves vLLM's shm multimodal cache: segment {segment!r}" in log
    assert report["tokens"] == lru_tokens  # greedy: the same tokens as vLLM's own cache
    assert len({tuple(t) for t in lru_tokens}) == 3  # the images matter to the outputs
    # 3 images, each sent twice: stored once, then a hit; every rank read every hand-out
    assert (report["puts"], report["hits"]) == (3, 3)
    assert (report["vllm_hits"], report["vllm_total"]) == (3, 6)
    assert report["n_readers"] == tp and report["reader_lag"] == [0] * tp
    assert report["corrupt_reads"] == [0] * tp
    pids = report["reader_pids"]
    assert all(pids) and len(set(pids)) == tp  # each TP rank attached as its own reader


def test_shmstore_serves_vllms_shm_cache_with_identical_outputs(
        model: Path, lru_tokens: list[list[int]]) -> None:
    """TP 1 here; TP 2 in the next test, whose engine runs the same prompts first."""
    segment = new_name("vllm-tp1")
    report = run_engine(model, "shm", 1, segment)
    served_identically(report, report["log"], segment, lru_tokens, 1)
    assert not Path("/dev/shm", segment).exists()  # the engine's exit unlinked it


def test_refused_and_aborted_requests_never_wedge_the_store_and_reset_keeps_requests_served(
        model: Path, lru_tokens: list[list[int]]) -> None:
    """TP 2, a store of about six images: first the standard prompts, whose outputs equal
    vLLM's own cache's; then one request vLLM refuses after rendering and three aborted before
    the engine steps, then rounds of new images; reset_mm_cache with six requests queued
    (tests/vllm/vllm_requests_run.py)."""
    segment = new_name("vllm-req")
    report = run_engine(model, "shm", 2, segment, runner=REQUESTS_RUNNER,
                        SHMSTORE_VLLM_SETTLE_S="1", RUN_WAIT_S="1.5")
    served_identically(report["standard"], report["log"], segment, lru_tokens, 2)
    assert "longer than the maximum model length" in report["refused_error"]
    assert report["after_abuse"]["refused"] == 1  # given back at once
    # aborted hand-outs no worker read were withdrawn once the store needed the space, so
    # no round sent an item inline (without settling: 0, 0, 6)
    assert report["inline_per_round"] == [0, 0, 0], report["settled"]
    assert report["settled"]["aborted"] == report["withdrawn"] <= 3
    # reset_mm_cache with six requests queued: the engine lives, the outputs are right
    assert report["tokens"] == lru_tokens
    assert report["tokens_across_reset"] == lru_tokens
    assert report["tokens_after_reset"] == lru_tokens
    assert report["reader_lag"] == [0, 0] and report["corrupt_reads"] == [0, 0]
    assert report["live_requests"] == 0  # every request the ledger saw has ended
    assert not Path("/dev/shm", segment).exists()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_tp_group_across_two_nodes_reads_through_the_relay(
        model: Path, lru_tokens: list[list[int]], tmp_path: Path) -> None:
    """TP 2 over two simulated nodes (vLLM --nnodes 2; node 1 headless, with its own store
    name, as on another machine): node 1's worker gets every item from its relay's store."""
    head, node = new_name("vllm-head"), new_name("vllm-node1")
    publish = f"tcp://127.0.0.1:{free_port()}"
    master_port = free_port()
    relay_log = (tmp_path / "relay.log").open("w+")
    node_log = (tmp_path / "node1.log").open("w+")
    relay = subprocess.Popen(
        [sys.executable, "-m", "shmstore", "relay", "connect", publish, "--name", node,
         "--readers", "1", "--insecure"], stdout=relay_log, stderr=subprocess.STDOUT, env=engine_env(node))
    node1 = subprocess.Popen(
        [sys.executable, str(RUNNER), str(model), "shm", "2", "2", "1", str(master_port)],
        stdout=node_log, stderr=subprocess.STDOUT,
        env=engine_env(node, VLLM_CPU_OMP_THREADS_BIND="1"), start_new_session=True)
    try:
        report = run_engine(model, "shm", 2, head, 2, 0, master_port,
                            SHMSTORE_VLLM_PUBLISH=publish, SHMSTORE_VLLM_INSECURE="1",
                            VLLM_CPU_OMP_THREADS_BIND="0")
        assert relay.wait(timeout=30) == 0  # the head's end reached the relay: it stops
    finally:
        os.killpg(node1.pid, signal.SIGTERM)  # headless workers run until told to stop
        node1.wait(timeout=60)
        relay.kill()
        relay.wait()
    relay_log.seek(0)
    relay_out = relay_log.read()
    assert report["tokens"] == lru_tokens, relay_out
    # the head stored 3 images and handed each out twice, all by handle (none inline)
    assert (report["puts"], report["hits"], report["inline_fallbacks"]) == (3, 3, 0)
    assert report["n_readers"] == 2  # its one local worker and the publisher
    assert report["reader_lag"] == [0, 0] and report["corrupt_reads"] == [0, 0]
    assert report["published"] == 6 and report["nodes_joined"] >= 1
    if report["nodes_joined"] == 1:
        assert (report["objects_sent"], report["refs_sent"]) == ([3], [3])  # each body once
        # node 1's relay stored each body once, served the repeats from its store
        assert ("relay stopped: end; messages 6, objects received 3, refs hit 3, needs 0, "
                "lost 0" in relay_out), relay_out
    else:  # a busy machine (seen with two spinning processes beside the suite) let a
        # heartbeat lapse: the relay joined again, and said so; the outputs above still agree
        assert "reconnecting" in relay_out, relay_out
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith((head, node))]

"""The benchmark scripts still run (tiny settings); their numbers are not checked here."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def run_script(script: str, *args: str, tmp_path: Path, timeout: float = 170) -> dict:
    out_json = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--json", str(out_json)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out_json.read_text())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_store_runs(tmp_path: Path) -> None:
    data = run_script("bench_store.py", "--quick", tmp_path=tmp_path)
    assert len(data["rows"]) == 4 and all(r["put_s"] > 0 for r in data["rows"])


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_bench_pipeline_runs_every_transport_and_the_queue_part_beside_vllms(
        tmp_path: Path) -> None:
    """One run of both parts (vLLM's baseline is imported by each of its processes: once)."""
    data = run_script("bench_pipeline.py", "--quick", "--sizes", "262144", "--readers", "1",
                      tmp_path=tmp_path, timeout=320)
    (row,) = data["transfer"]
    assert row["n_readers"] == 1 and row["shmstore_s"] > 0 and row["shm-per-item_s"] > 0
    assert row["torch.mp.Queue_s"] > 0 and row["pipe_s"] > 0
    queues = [("shmstore", 1)] + ([("vllm", 1)] if HAVE_VLLM else [])
    assert [(q["queue"], q["n_readers"]) for q in data["queue"]] == queues
    assert all(q["flood"]["msgs_per_s"] > 0 for q in data["queue"])
    assert 0 <= data["idle_reader_cpu_share"] <= 1
    if HAVE_VLLM:  # vLLM's own storage and MessageQueue (setup installs vllm)
        assert row["vllm shm_s"] > 0
        assert 0 <= data["vllm_idle_reader_cpu_share"] <= 1


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_hitrate_runs_every_column(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_hitrate.py"), "--requests",
                           "1500", "--families", "zipf-0.8,chat", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=170,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "goal missed at:" in proc.stdout
    rows = (tmp_path / "hitrate.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 4 and "libcachesim_s3fifo" in rows[0]
    assert (tmp_path / "hitrate.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_policy_goal_checks_every_cell(tmp_path: Path) -> None:
    out = run_printing_script("bench_policy_goal.py", "--seeds", "0,1", "--requests", "1500",
                              "--families", "zipf-0.8,chat", "--out", str(tmp_path))
    assert "shm_adaptive:" in out and "of 16 cells below lru - 0.5" in out
    rows = (tmp_path / "policy_goal.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 * 4 and "rule_at_end" in rows[0]
    assert "libcachesim_arc" in rows[0] and "libcachesim_lecar: " in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_policy_cost_runs() -> None:
    out = run_printing_script("bench_policy_cost.py", "--capacity-mib", "2")
    for policy in ("fifo", "freq", "adaptive"):
        assert f"{policy}: hit" in out
    assert "adaptive's shadows alone (requested): hit" in out
    assert out.count("bytes per object)") == 3
    assert " adaptive / freq: hit " in out and " adaptive - freq: " in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_relay_runs(tmp_path: Path) -> None:
    data = run_script("bench_relay.py", "--items", "2", "--sizes", "1", tmp_path=tmp_path)
    methods = {row["method"] for row in data["rows"]}
    assert methods == {"shmstore relay", "pub/sub pickled", "per reader"}
    relay = next(r for r in data["rows"] if r["method"] == "shmstore relay")
    pubsub = next(r for r in data["rows"] if r["method"] == "pub/sub pickled")
    assert relay["mb_per_item"] < pubsub["mb_per_item"]  # bytes, not speed: hits cross as REFs


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_relay_flood_runs(tmp_path: Path) -> None:
    data = run_script("bench_relay_flood.py", "--nodes", "2", "--window", "4", "--mib", "0.25",
                      "--seconds", "2", tmp_path=tmp_path)
    assert data["messages_sent"] > 0 and data["nodes"] == 2
    assert data["needs_served"] > 0  # the rogues' NEEDs reached the Publisher


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm (scripts/setup.sh installs it)")
def test_bench_byvalue_runs(tmp_path: Path) -> None:
    data = run_script("bench_byvalue.py", "--sizes", "112", "--n", "5", tmp_path=tmp_path)
    (row,) = data["rows"]
    assert row["image_px"] == 112 and row["by_value_ms"] > 0 and row["by_handle_ms"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm (scripts/setup.sh installs it)")
def test_bench_pool_runs_from_a_second_process_through_the_client() -> None:
    out = run_printing_script("bench_pool.py", "--photos", "2", "--rounds", "1",
                              "--megapixels", "0.3", "--client", "--processor-cpu",
                              timeout=280)
    assert "from a second process, through the client" in out, out
    for n in (1, 2):
        assert re.search(rf"pool of {n}: the processor itself, inside its workers, [\d.]+ ms",
                         out), out
    for label in ("in process", "2 processes at once", "pool of 1, shm", "pool of 1, msg",
                  "pool of 2, shm", "pool of 2, msg"):
        assert re.search(rf"^{label} +[\d.]+ \[", out, re.M), out


def run_printing_script(script: str, *args: str, timeout: float = 170) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_percall_breaks_every_call_down() -> None:
    out = run_printing_script("bench_percall.py", "--size", "4096", "--repeats", "2")
    for call in ("put of 4096 B", "get of 4096 B (owned copy)", "view of 4096 B (zero copy)"):
        assert call in out
    assert out.count("rest: ") == 3 and "key digest" in out and "decode, zero copy" in out
    assert "queue, a float message: put" in out
    assert "a second API server's call to the store's host" in out
    assert "cached:" in out and "hand_out_cached + give_back:" in out and "(watcher" in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_wakeup_runs() -> None:
    # unpaced: each one-slot hand-off meets a writer faster than its reader (a loaded machine's
    # case: the C-calls reader once found message 10 where 9 was due)
    out = run_printing_script("bench_wakeup.py", "--messages", "10", "--gap-ms", "0")
    assert "put to get p50" in out and "bare semaphore, same pacing: p50" in out
    assert "hand-off of C calls only (" in out
    assert "iceoryx2 event, same pacing: p50" in out or "iceoryx2, same pacing: skipped" in out


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm (scripts/setup.sh installs it)")
def test_bench_serve_reports_and_plots_a_saved_run(tmp_path: Path) -> None:
    """The saved run in bench/saved redraws (the servers themselves run in the vLLM tests)."""
    png = tmp_path / "serve.png"
    out = run_printing_script("bench_serve.py", "--from-json",
                              str(ROOT / "bench" / "saved" / "serve_672.json"), "--plot", str(png))
    assert "dp2-shmstore / dp2-fallback" in out and png.stat().st_size > 10_000


def test_bench_frontends_prints_shared_against_separate(tmp_path: Path) -> None:
    out = run_printing_script("bench_frontends.py", "--quick", "--families", "zipf-0.8",
                              "--frontends", "2", "--out", str(tmp_path))
    assert "shared - separate lru" in out and "zipf-0.8  2  25%" in out
    rows = list(csv.DictReader(open(tmp_path / "frontends.csv")))
    assert len(rows) == 4 and all(float(r["shared_adaptive"]) > float(r["separate_lru"]) for r in rows)


@pytest.mark.slow
def test_bench_scrape_compares_stats_with_the_full_walk() -> None:
    out = run_printing_script("bench_scrape.py", "--objects", "2000", "--readers", "3")
    assert "2,000 objects, 3 readers" in out
    for label in ("stats()", "walk of every object", "Prometheus scrape", "stats() / walk"):
        assert label in out, out
    lagging = run_printing_script("bench_scrape.py", "--objects", "2000", "--readers", "3",
                                  "--lagging")
    assert "(the last stopped) and one never attached" in lagging, lagging
    owed = re.search(r"reads owed: (\d+), (\d+), ([\d,]+), ([\d,]+)$", lagging, re.M)
    assert owed, lagging  # the stopped reader and the one never attached owe every object
    assert owed.group(3) == owed.group(4) and int(owed.group(3).replace(",", "")) >= 2_000
    for label in ("nothing", "stats()", "the walk"):
        assert re.search(rf"{re.escape(label)} +[\d.]+ / +[\d.]+ ms", lagging), lagging


@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm (scripts/setup.sh installs it)")
def test_bench_serve_dumps_every_process_of_a_server_whose_request_waits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--dump-after: the stacks of the server's first process and of each one below it (py-spy
    where installed; without it, the file still names them and says why it has no stacks)."""
    import time
    import types

    from bench import bench_serve
    from tests._waiting import wait_for

    script = ("import subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print('ready', flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"ready\n"
        wait_for(lambda: bench_serve.descendants(parent.pid), 30, "the server's child")
        child = bench_serve.descendants(parent.pid)[0]
        monkeypatch.setattr(bench_serve, "DUMPS", [0.6, tmp_path])
        server = types.SimpleNamespace(proc=types.SimpleNamespace(pid=parent.pid))
        bench_serve.dump_waiting(server, 7, time.time() - 0.7)  # type: ignore[arg-type]
        (dump,) = tmp_path.iterdir()
        text = dump.read_text()
        assert text.startswith("request image 7, waiting 0.7")
        assert f"===== pid {parent.pid}" in text and f"===== pid {child}" in text
        stacks = len(re.findall(r"^Thread \d+ ", text, re.M))  # py-spy's, one a thread
        assert stacks == 2 or text.count("py-spy is not installed") == 2, text
    finally:
        for pid in bench_serve.descendants(parent.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        parent.kill()
        parent.wait(30)
        if parent.stdout is not None:
            parent.stdout.close()

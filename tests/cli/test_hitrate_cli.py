"""`shmstore hitrate`: every trace format, the outputs, and clear errors for bad input."""

from __future__ import annotations

import csv
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shmstore.cache._hitsim import SIM_KINDS, SimStats, real_hits, replay, replay_split, route_index
from shmstore.cli._hitrate import TraceError, parse_budgets, read_trace, recommend
from shmstore.cli._traces import ORACLE_GENERAL
from tests import _shm

TRACE = [(f"img-{k}", 1000 + 37 * (k % 11)) for k in
         (np.random.default_rng(3).zipf(1.3, 3000) % 400)]


def hitrate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmstore", "hitrate", "--no-progress", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_csv_with_header_replays_verifies_and_writes_csv_and_png(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time,key,bytes\n" + "".join(f"{i},{k},{n}\n"
                                                 for i, (k, n) in enumerate(TRACE)))
    done = hitrate(str(path), "--out", str(tmp_path), "--verify", "400", "--workers", "4",
                   "--budgets", "5%,20%", "--target", "0.5")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "3,000 requests" in out and "verified: the first 400 requests" in out
    assert "recommended: cache kind" in out
    rows = list(csv.DictReader(open(tmp_path / "hitrate.csv")))
    assert [r["kind"] for r in rows] == list(SIM_KINDS) * 2
    expected = replay(TRACE, SIM_KINDS, [int(p * sum(dict(TRACE).values()) / 100)
                                         for p in (5, 20)], 4)
    assert [float(r["hit_ratio"]) for r in rows] == pytest.approx([s.hit_ratio for s in expected])
    lru = next(r for r in rows if r["kind"] == "lru")
    assert int(lru["memory_bytes"]) == 4 * int(lru["budget_bytes"])  # a mirror per worker
    assert (tmp_path / "hitrate.png").read_bytes()[:4] == b"\x89PNG"


def test_libcachesim_csv_columns_and_oracle_general_read_the_same_requests(tmp_path: Path) -> None:
    ids = {k: i + 1 for i, k in enumerate(dict.fromkeys(k for k, _ in TRACE))}
    lcs = tmp_path / "lcs.csv"  # libCacheSim style: no header, other order, other delimiter
    lcs.write_text("".join(f"{n};{i};{ids[k]}\n" for i, (k, n) in enumerate(TRACE)))
    from_csv = read_trace(lcs, columns="obj-size-col=1,time-col=2,obj-id-col=3")
    assert from_csv == [(str(ids[k]), n) for k, n in TRACE]
    records = np.zeros(len(TRACE), ORACLE_GENERAL)
    records["time"] = np.arange(len(TRACE))
    records["id"] = [ids[k] for k, _ in TRACE]
    records["size"] = [n for _, n in TRACE]
    binary = tmp_path / "trace.oracleGeneral"
    records.tofile(binary)
    assert read_trace(binary) == [(ids[k], n) for k, n in TRACE]
    assert read_trace(binary, limit=10) == [(ids[k], n) for k, n in TRACE[:10]]
    unsorted = tmp_path / "unsorted.csv"  # replayed by time
    unsorted.write_text("timestamp,obj_id,obj_size\n3,c,30\n1,a,10\n2,b,20\n")
    assert read_trace(unsorted) == [("a", 10), ("b", 20), ("c", 30)]


@pytest.mark.parametrize("content, options, message", [
    ("time,key,bytes\n1,a,ten\n", [], "line 2"),
    ("1,a,-5\n", [], "negative size"),
    ("when,what\n1,a\n", [], "--columns"),
    ("1,a,5\n", ["--columns", "key=2,size=x"], "NAME=NUMBER"),
    ("1,a,5\n", ["--budgets", "lots"], "neither a percent"),
    ("1,a,5\n", ["--budgets", "10"], "a size with its unit"),  # once 10 bytes, silently
    ("1,a,5\n", ["--kinds", "shm-fifo,arc"], "choose from"),
    ("", [], "no requests"),
])
def test_bad_input_exits_2_with_a_message_that_says_what_to_do(
        tmp_path: Path, content: str, options: list[str], message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    done = hitrate(str(path), "--out", str(tmp_path), *options)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "hitrate.csv").exists()


def test_truncated_oracle_general_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "x.oracleGeneral"
    path.write_bytes(bytes(ORACLE_GENERAL.itemsize * 3 + 5))
    with pytest.raises(TraceError, match="whole number"):
        read_trace(path)
    done = hitrate(str(tmp_path / "nope.csv"))
    assert done.returncode == 2 and "nope.csv" in done.stderr


def test_budgets_in_percent_and_units() -> None:
    assert parse_budgets("10%, 2GiB,512MB", 1000) == [("10%", 100), ("2GiB", 2 << 30),
                                                       ("512MB", 512 * 10**6)]
    with pytest.raises(TraceError, match="less than one byte"):
        parse_budgets("0.01%", 1000)


@pytest.mark.parametrize(("content", "args", "message"), [
    (b"time,key,bytes\n0,ok,10\n1,\xff\xfe,10\n", (), "line 3: the key is not UTF-8"),
    (b"time,key,bytes\n0,ok,10\n1," + b"k" * (200 << 10) + b",10\n", (), "line 3:.*field"),
    (b"time,key,bytes\n0,ok,10\n1,huge,1152921504606846976\n", (), "line 3: size"),
    (b"time,key,bytes\n0,a,10\n", ("--budgets", "inf%"), "--budgets: 'inf%'"),
    (b"time,key,bytes\n0,a,10\n", ("--budgets", "1e30%"), "--budgets: '1e30%'"),
    (b"time,key,bytes\n0,a,10\n", ("--budgets", "nan%"), "--budgets: 'nan%'"),
    (b"time,key,bytes\n0,a,10\n", ("--budgets", "99999999999999999999TiB"), "above 1 PiB"),
    (b"0,a,10\n", ("--delimiter", "ab"), "--delimiter 'ab'"),
    (b"0,a,10\n", ("--columns", "key=0,bytes=3"), "key must name a column"),
    (b"0,a,10\n", ("--limit", "-1"), "--limit -1"),
    (b"0,a,10\n", ("--limit", "0"), "--limit 0"),
    (b"0,a,10\n", ("--target", "nan"), r"--target nan: a hit ratio in \(0, 1\]"),
    (b"0,a,10\n", ("--target", "-1"), "--target -1"),
    (b"0,a,10\n", ("--target", "2"), "--target 2"),
    (b"0,a,10\n", ("--target", "80"), "--target 80.0: .*0.8 for 80%"),
    (b"0,a,10\n", ("--verify", "-5"), "--verify -5"),
])
def test_hostile_traces_and_options_exit_2_naming_the_line_or_option(
        tmp_path: Path, content: bytes, args: tuple[str, ...], message: str) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes(content)
    done = hitrate(str(path), "--out", str(tmp_path), "--verify", "0", *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert re.search(message, done.stderr), done.stderr


def test_a_key_seen_large_then_small_counts_at_its_largest_and_verify_stays_small(
        tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    rows = ["0,big,10737418240", "1,big,1000"] + [f"{i},k{i % 5},2000" for i in range(2, 60)]
    path.write_text("\n".join(rows) + "\n")
    done = hitrate(str(path), "--out", str(tmp_path), "--verify", "60", "--budgets", "50%")
    assert done.returncode == 0, done.stderr
    assert "working set 10.0 GiB" in done.stdout or "10.0GiB" in done.stdout, done.stdout
    assert "verified: the first 60 requests" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 128 + signal.SIGTERM),
                                         (signal.SIGINT, 130)])
@pytest.mark.alone
def test_hitrate_stopped_leaves_nothing_in_dev_shm(tmp_path: Path, sig: signal.Signals,
                                                   status: int) -> None:
    """SIGTERM exits 143; Ctrl-C (SIGINT) ends with one line and 130, no traceback."""
    path = tmp_path / "t.csv"
    path.write_text("".join(f"{i},k{i % 300},{200_000 + i % 7}\n" for i in range(20_000)))
    before = _shm.entries()
    proc = subprocess.Popen([sys.executable, "-m", "shmstore", "hitrate", "--no-progress",
                             str(path), "--out", str(tmp_path), "--verify", "20000",
                             "--budgets", "5%,10%,25%,50%"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # wait until the verify step has stores in shared memory, then stop it
        end = time.monotonic() + 60
        while time.monotonic() < end and not _shm.made_by(proc.pid, before):
            time.sleep(0.01)
        assert time.monotonic() < end, "the verify step never started"
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == status
        err = proc.stderr.read() if proc.stderr else ""
        assert "Traceback" not in err, err
        if sig == signal.SIGINT:
            assert err.strip().splitlines()[-1] == "shmstore hitrate: interrupted; nothing written"
    finally:
        proc.kill()
        proc.wait()
    assert not _shm.left_since(before)
    assert not (tmp_path / "hitrate.csv").exists()


@pytest.mark.slow
def test_frontends_compare_one_shared_cache_with_one_per_frontend(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time,key,bytes,session\n" + "".join(
        f"{i},{k},{n},s{i % 7}\n" for i, (k, n) in enumerate(TRACE)))
    done = hitrate(str(path), "--out", str(tmp_path), "--verify", "0", "--budgets", "5%,20%",
                   "--frontends", "3", "--kinds", "shm-freq,lru")
    assert done.returncode == 0, done.stderr
    assert "3 front ends, requests in turn (1,000-1,000 each)" in done.stdout
    rows = list(csv.DictReader(open(tmp_path / "hitrate.csv")))
    budgets = [int(r["budget_bytes"]) for r in rows[::2]]
    turns = [i % 3 for i in range(len(TRACE))]
    expected = replay_split(TRACE, turns, 3, ["shm-freq", "lru"], budgets, 8)
    assert [float(r["separate_hit_ratio"]) for r in rows] == pytest.approx(
        [s.hit_ratio for s in expected])
    assert all(r["frontends"] == "3" for r in rows)
    # by the session column: each session's requests stay on one front end
    done = hitrate(str(path), "--out", str(tmp_path), "--verify", "0", "--budgets", "5%",
                   "--frontends", "2", "--route", "column", "--kinds", "shm-freq")
    assert done.returncode == 0, done.stderr
    routed = [route_index(f"s{i % 7}", 2) for i in range(len(TRACE))]
    counts = np.bincount(routed, minlength=2)
    assert f"requests by the route column ({counts.min():,}-{counts.max():,} each)" in done.stdout
    row = next(csv.DictReader(open(tmp_path / "hitrate.csv")))
    split = replay_split(TRACE, routed, 2, ["shm-freq"], [int(row["budget_bytes"])], 8)
    assert float(row["separate_hit_ratio"]) == pytest.approx(split[0].hit_ratio)


@pytest.mark.parametrize(("content", "args", "message"), [
    ("time,key,bytes\n0,a,10\n", ("--frontends", "0"), "--frontends 0"),
    ("time,key,bytes\n0,a,10\n", ("--frontends", "5000"), "--frontends 5000"),
    ("time,key,bytes\n0,a,10\n", ("--frontends", "2", "--route", "column"), "no route column"),
    ("time,key,bytes,user\n0,a,10\n1,b,10,u\n", ("--frontends", "2", "--route", "column"),
     "line 2: .* a route in column 4"),
    ("0,a,10,x\n", ("--frontends", "2", "--route", "column", "--columns", "key=2,bytes=3,route=0"),
     "route must name a column"),
])
def test_bad_frontend_options_exit_2_saying_what_to_pass(
        tmp_path: Path, content: str, args: tuple[str, ...], message: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(content)
    done = hitrate(str(path), "--out", str(tmp_path), "--verify", "0", *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.stdout, done.stderr)
    assert re.search(message, done.stderr), done.stderr


def test_an_oracle_general_trace_has_no_route_column(tmp_path: Path) -> None:
    path = tmp_path / "x.oracleGeneral"
    np.zeros(4, ORACLE_GENERAL).tofile(path)
    with pytest.raises(TraceError, match="no route column"):
        read_trace(path, routes=[])
    assert len(read_trace(path)) == 4


def test_routes_follow_the_requests_when_a_trace_is_sorted_by_time(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time,key,bytes,frontend\n3,c,10,z\n1,a,10,x\n2,b,10,y\n")
    routes: list[str] = []
    assert read_trace(path, routes=routes) == [("a", 10), ("b", 10), ("c", 10)]
    assert routes == ["x", "y", "z"]


def test_out_naming_a_file_is_refused_before_any_work(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("".join(f"{i},{k},{n}\n" for i, (k, n) in enumerate(TRACE)))
    target = tmp_path / "a-file"
    target.write_text("mine")
    done = hitrate(str(trace), "--out", str(target))
    assert done.returncode == 2 and "--out" in done.stderr and "not a directory" in done.stderr
    assert "Traceback" not in done.stderr and "replayed" not in done.stdout  # no work done
    assert target.read_text() == "mine"


@pytest.mark.parametrize("args, message", [
    (("--workers", "0"), "--workers 0"),
    (("--kinds", "shm-fifo,belady"), "--kinds"),
    (("--budgets", "5x"), "--budgets: '5x'"),
    (("--budgets", ","), "--budgets"),
    (("--frontends", "0"), "--frontends 0"),
    (("--target", "80"), "--target 80"),
    (("--out", "/nonexistent-parent/report"), "--out"),
])
def test_every_option_is_checked_before_the_trace_is_read(tmp_path: Path, args: tuple[str, ...],
                                                          message: str) -> None:
    """A bad option is named even when the trace does not exist: options come first."""
    done = hitrate(str(tmp_path / "missing.csv"), *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "missing.csv" not in done.stderr and "Traceback" not in done.stderr


def test_slow_steps_say_what_they_do(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("".join(f"{i},{k},{n}\n" for i, (k, n) in enumerate(TRACE[:300])))
    done = subprocess.run([sys.executable, "-m", "shmstore", "hitrate", str(trace), "--out",
                           str(tmp_path / "new-folder"), "--verify", "100", "--budgets", "50%"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"reading {trace} ..." in done.stderr
    assert "checking the first 100 requests against the real caches" in done.stderr
    assert (tmp_path / "new-folder" / "hitrate.csv").exists()  # --out made when missing


def _stats(kind: str, budget: int, hits: int) -> SimStats:
    return SimStats(kind, budget, 100, hits, 100, hits, 0, 0, 0)


def test_the_recommendation_prefers_the_default_on_a_tie_and_says_why_when_it_does_not() -> None:
    tie = [_stats(k, 10, 80) for k in ("shm-fifo", "shm-freq", "shm-adaptive", "lru")]
    lines = recommend(tie, 0.7, workers=8)
    assert lines[-1].startswith("recommended: cache kind shm-adaptive")
    ahead = [_stats("shm-freq", 10, 80), _stats("shm-adaptive", 10, 60),
             _stats("shm-adaptive", 20, 85)]
    lines = recommend(ahead, 0.7, workers=8)
    assert lines[-2].startswith("recommended: cache kind shm-freq")
    assert "shm-adaptive, the default, needs 20 B" in lines[-1]


def test_the_check_takes_a_hit_as_the_value_stored_whatever_size_the_trace_asks_now() -> None:
    """A trace may give one key several sizes; the real cache then returns what it stored."""
    trace = [("a", 1000), ("b", 500), ("a", 3000), ("a", 200), ("b", 500)]
    assert real_hits("shm-fifo", trace, 1 << 20, 2) == [False, False, True, True, True]


def _resizing_trace(seed: int, n: int = 3000) -> list[tuple[str, int]]:
    """Zipf-like keys whose sizes vary, one in fifty 3 MB (more than the small rings)."""
    import random

    rng = random.Random(seed)
    return [(f"k{int(rng.paretovariate(1.0)) % 40}",
             rng.choice([50_000, 150_000, 300_000]) if rng.random() > 0.02 else 3_000_000)
            for _ in range(n)]


def test_a_ring_replay_survives_a_hit_whose_size_grew_past_the_ring() -> None:
    """adaptive's shadows were asked to admit a chunk larger than their ring (InvalidArgument:
    'a chunk of 3000192 bytes cannot go in a ring of 2000000 bytes')."""
    from shmstore.cache._hitsim import RingSim

    for seed in range(4):
        sims = [RingSim(kind.removeprefix("shm-"), 2_000_000, 2) for kind in SIM_KINDS
                if kind.startswith("shm-")]
        for key, nbytes in _resizing_trace(seed):
            for sim in sims:
                sim.request(key, nbytes)
        assert all(sim.stats().requests == 3000 for sim in sims)


@pytest.mark.parametrize("verify", ["0", "300"])
def test_a_trace_whose_sizes_vary_per_key_replays_and_verifies(tmp_path: Path,
                                                               verify: str) -> None:
    """It crashed (rc 1, nothing written): InvalidArgument from adaptive's shadows, or the
    check's 'please report this' (the real cache charges a hit the size it stored)."""
    path = tmp_path / "t.csv"
    path.write_text("time,key,bytes\n" + "".join(f"{i},{k},{n}\n"
                                                 for i, (k, n) in enumerate(_resizing_trace(1))))
    done = hitrate(str(path), "--out", str(tmp_path), "--verify", verify,
                   "--budgets", "2%,10%,40%", "--frontends", "2")
    assert done.returncode == 0, done.stderr
    assert "items have more than one size in the trace: each is replayed at its largest" in \
        done.stdout
    assert (tmp_path / "hitrate.csv").exists()
    if verify != "0":
        assert "verified: the first 300 requests" in done.stdout

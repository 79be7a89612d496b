"""`shmstore hitrate TRACE`: the caches' hit ratios on a user's own trace, and what to run.

    shmstore hitrate requests.csv [--budgets 1%,5%,10%,25%] [--workers 8] [--target 0.6]

Reads the trace (below), replays it through every cache kind at every budget on metadata
alone (cache/_hitsim.py: the same ring, policies and LRU as the real caches; a progress bar on
stderr), checks a sample request by request against the real caches in shared memory
(`--verify N`, scaled down), prints a table, writes hitrate.csv and hitrate.png into --out,
and ends with a recommendation: the kind and budget that reach the target hit ratio, and the
memory each kind needs with N workers (an shm kind: one copy; lru: one mirror per worker).

With `--frontends N` the trace is also replayed as N front ends (API servers) with a cache
each, every budget split N ways: the same total memory as one shared cache, which is what a
shared shmstore store gives several API servers. Requests reach the front ends in turn, or
with `--route column` by a stable hash of the trace's route column (a session or user id).

Trace formats (`--format`, guessed from the name and the first bytes when not given):

    csv             one request per line: time or order, key, bytes (a header line with those
                    names, or timestamp/obj_id/obj_size, is recognised and skipped). Other
                    layouts: `--columns time=1,key=2,bytes=3` (1-based; libCacheSim's
                    time-col/obj-id-col/obj-size-col names work too) and `--delimiter`.
    oracleGeneral   libCacheSim's binary format: 24 bytes per request (u32 time, u64 object id,
                    u32 size, i64 next access), uncompressed.

`bytes` is the item's size as the cache stores it (serialized tensors); requests are replayed
in file order, or by time when the time column is given and not sorted.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..cache._hitsim import (
    SIM_KINDS,
    SimStats,
    make_sim,
    one_size_per_key,
    real_hits,
    replay,
    replay_split,
    route_index,
    working_set_bytes,
    write_csv,
)
from ._traces import Trace, TraceError, read_trace
from ._units import format_size, parse_size

__all__ = ["add_arguments", "main", "read_trace", "TraceError", "recommend"]

DEFAULT_BUDGETS = "1%,2%,5%,10%,25%,50%"
MAX_BUDGET_BYTES = 1 << 50  # 1 PiB
MAX_FRONTENDS = 1024  # API servers on one node; more is a typo
DEFAULT_KIND = "shm-adaptive"  # the caches' default, and the docs' recommendation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="the trace file (csv or oracleGeneral)")
    parser.add_argument("--format", choices=("csv", "oracleGeneral"), default=None,
                        help="the trace's format (default: guessed from its name and first bytes)")
    parser.add_argument("--columns", default=None,
                        help="csv columns, 1-based (default: time=1,key=2,bytes=3; time=0: none)")
    parser.add_argument("--delimiter", default=None, help="csv delimiter (default: guessed)")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS,
                        help="cache sizes: percents of the working set or sizes (512MiB, 4GiB); "
                             "default: %(default)s")
    parser.add_argument("--kinds", default=",".join(SIM_KINDS),
                        help="cache kinds to compare (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=8,
                        help="workers reading every item, the TP size: lru keeps a mirror in "
                             "each, so it sets lru's memory (default: %(default)s)")
    parser.add_argument("--target", type=_ratio, default=None,
                        help="hit ratio to reach, as 0.8 or 80%% (default: 90%% of an unbounded "
                             "cache's)")
    parser.add_argument("--limit", type=int, default=None,
                        help="replay the first N requests (default: all)")
    parser.add_argument("--verify", type=int, default=1000,
                        help="check the first N requests against the real caches (0: skip; "
                             "default: %(default)s)")
    parser.add_argument("--frontends", type=int, default=1,
                        help="also replay N front ends (API servers): one shared cache against "
                             "N separate caches of the same total memory (default: %(default)s, "
                             "no comparison)")
    parser.add_argument("--route", choices=("roundrobin", "column"), default="roundrobin",
                        help="how requests reach the front ends: in turn, or by the trace's "
                             "route column (--columns ...,route=N; a stable hash of its value; "
                             "default: %(default)s)")
    parser.add_argument("--out", default=".",
                        help="folder for hitrate.csv and hitrate.png (default: the current one)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (there is none either when stderr is not a "
                             "terminal: a log gets one line per step)")


def _ratio(text: str) -> float:
    """--target as 0.8 or 80%; a value outside (0, 1] is refused later, with the others."""
    try:
        return float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a hit ratio: give 0.8 or 80%") \
            from None


# -- budgets and the replay -----------------------------------------------------------------------

def budget_spec(spec: str) -> list[tuple[str, float | None, int | None]]:
    """(label, percent, None) or (label, None, bytes) per budget of `spec`: "5%" of the
    working set, or "4GiB". Raises TraceError naming the budget that is neither."""
    budgets: list[tuple[str, float | None, int | None]] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            if part.endswith("%"):
                percent = float(part[:-1])
                if not 0 < percent <= 1e6:  # also nan and inf
                    raise ValueError(part)
                budgets.append((part, percent, None))
            elif part.replace(".", "", 1).isdigit():  # a bare number: bytes, or a forgotten %?
                raise ValueError(part)
            else:
                budgets.append((part, None, parse_size(part)))
        except (ValueError, OverflowError):
            raise TraceError(f"--budgets: {part!r} is neither a percent (5%, up to 1000000%) nor "
                             "a size with its unit (512MiB, 4GiB, 1000B)") from None
    if not budgets:
        raise TraceError(f"--budgets {spec!r}: give at least one, e.g. 5%,10%,4GiB")
    return budgets


def parse_budgets(spec: str, working_set: int) -> list[tuple[str, int]]:
    """(label, bytes) per budget of `spec`: "5%" of the working set, or "4GiB"."""
    budgets = []
    for part, percent, size in budget_spec(spec):
        nbytes = int(percent * working_set / 100) if percent is not None else int(size or 0)
        if nbytes < 1:
            raise TraceError(f"--budgets: {part!r} is less than one byte of this trace")
        if nbytes > MAX_BUDGET_BYTES:
            raise TraceError(f"--budgets: {part!r} is {nbytes} bytes, above 1 PiB; give a "
                             "smaller budget")
        budgets.append((part, nbytes))
    return budgets


def recommend(stats: Sequence[SimStats], target: float, workers: int) -> list[str]:
    """Lines saying, per kind, the smallest budget tried that reaches `target` and its memory,
    then the kind that needs the least memory for it (on a tie, the default kind, then the
    higher hit ratio)."""
    lines = []
    choices: list[tuple[int, bool, float, str, int]] = []
    for kind in dict.fromkeys(s.kind for s in stats):
        runs = sorted((s for s in stats if s.kind == kind), key=lambda s: s.capacity_bytes)
        good = next((s for s in runs if s.hit_ratio >= target), None)
        if good is None:
            lines.append(f"  {kind:<13} does not reach {target:.1%} at the budgets tried "
                         f"(best {runs[-1].hit_ratio:.1%} at {format_size(runs[-1].capacity_bytes)})")
            continue
        memory = good.capacity_bytes * (workers if kind == "lru" else 1)
        where = (f"{workers} mirrors of {format_size(good.capacity_bytes)}" if kind == "lru"
                 else "one shared copy")
        lines.append(f"  {kind:<13} {good.hit_ratio:.1%} at a budget of "
                     f"{format_size(good.capacity_bytes)}: {format_size(memory)} of memory ({where})")
        choices.append((memory, kind != DEFAULT_KIND, -good.hit_ratio, kind, good.capacity_bytes))
    if choices:
        memory, _, _, kind, budget = min(choices)
        lines.append(f"recommended: cache kind {kind} with a budget of {format_size(budget)} "
                     f"({format_size(memory)} of memory in all with {workers} workers)")
        default = next((c for c in choices if c[3] == DEFAULT_KIND), None)
        if kind != DEFAULT_KIND and default is not None:
            lines.append(f"  ({DEFAULT_KIND}, the default, needs {format_size(default[0])} on this "
                         f"trace; it is the default because no trace family here puts it far "
                         f"below the best: docs/caching.md)")
    else:
        lines.append("recommended: no kind reaches the target at these budgets; try larger "
                     "--budgets or a lower --target")
    return lines


def _progress_bar(total: int, disabled: bool, desc: str
                  ) -> tuple[Callable[[int], None], Callable[[], None]]:
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety: pip install tqdm
        disabled = True
    if disabled or not sys.stderr.isatty():  # in a log, a bar is a flood of redrawn lines
        return (lambda n: None), (lambda: None)
    bar = tqdm(total=total, unit="req", unit_scale=True, file=sys.stderr, desc=desc)
    return bar.update, bar.close


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)  # unwinds: the verify step closes (and unlinks) its stores


def main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(args)
    except KeyboardInterrupt:  # the stores of the check were closed (and unlinked) on the way
        print("\nshmstore hitrate: interrupted; nothing written", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    try:
        kinds = _check_options(args)
        routes: list[str] | None = [] if args.frontends > 1 and args.route == "column" else None
        _say(args, f"reading {args.trace}")
        trace = read_trace(args.trace, args.format, args.columns, args.delimiter, args.limit,
                           routes)
        if not trace:
            raise TraceError(f"{args.trace}: no requests")
        trace, resized = one_size_per_key(trace)
        working_set = working_set_bytes(trace)
        budgets = parse_budgets(args.budgets, working_set)
    except (TraceError, OSError) as exc:
        print(f"shmstore hitrate: {exc}", file=sys.stderr)
        return 2
    unique = len({k for k, _ in trace})
    infinite = 1 - unique / len(trace)
    target = args.target if args.target is not None else 0.9 * infinite
    print(f"{args.trace}: {len(trace):,} requests, {unique:,} items, working set "
          f"{format_size(working_set)}, unbounded cache {infinite:.1%}; {args.workers} workers")
    if resized:
        print(f"{resized:,} items have more than one size in the trace: each is replayed at its "
              "largest (a key names one content, and a hit is the value stored)")
    t0 = time.perf_counter()
    update, done = _progress_bar(len(trace), args.no_progress, "replaying")
    try:
        stats = replay(trace, kinds, [b for _, b in budgets], args.workers, update)
    finally:
        done()
    elapsed = time.perf_counter() - t0
    rows = _table(stats, budgets, kinds, working_set, len(trace), args.workers)
    print(f"replayed {len(trace) * len(stats):,} cache requests in {elapsed:.1f} s")
    if args.frontends > 1:
        _frontends_table(trace, routes, args, kinds, budgets, stats, rows)
    if args.verify:
        sample = trace[:args.verify]
        _say(args, f"checking the first {len(sample):,} requests against the real caches in "
                   f"shared memory ({len(kinds)} kinds x {len(budgets)} budgets)")
        update, done = _progress_bar(len(sample) * len(kinds) * len(budgets), args.no_progress,
                                     "checking")
        try:
            checked = verify(sample, kinds, [b / working_set for _, b in budgets], progress=update)
        finally:
            done()
        print(checked)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "hitrate.csv")
    written = [out / "hitrate.csv"]
    if _plot(rows, kinds, out / "hitrate.png", target):
        written.append(out / "hitrate.png")
    print(f"for a hit ratio of {target:.1%}:")
    print("\n".join(recommend(stats, target, args.workers)))
    print("wrote " + " and ".join(str(p) for p in written))
    return 0


def _say(args: argparse.Namespace, line: str) -> None:
    """A line on stderr before a step that may take more than a second."""
    if not args.no_progress:
        print(f"{line} ...", file=sys.stderr, flush=True)


def _check_options(args: argparse.Namespace) -> list[str]:
    """Refuse, before any work, an option that would be silently wrong (TraceError, exit 2);
    returns the kinds to compare."""
    if args.frontends < 1 or args.frontends > MAX_FRONTENDS:
        raise TraceError(f"--frontends {args.frontends}: give 1 to {MAX_FRONTENDS} (1: one "
                         "front end, no comparison)")
    if args.workers < 1:
        raise TraceError(f"--workers {args.workers}: the number of workers reading every item, "
                         "at least 1")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in SIM_KINDS]
    if bad or not kinds:
        raise TraceError(f"--kinds: {bad or kinds!r}; choose from {','.join(SIM_KINDS)}")
    budget_spec(args.budgets)  # their bytes wait for the working set
    target = args.target
    if target is not None and not (math.isfinite(target) and 0 < target <= 1):
        raise TraceError(f"--target {target}: a hit ratio in (0, 1], e.g. 0.8 for 80%")
    if args.verify < 0:
        raise TraceError(f"--verify {args.verify}: the number of requests to check (0: skip)")
    if args.limit is not None and args.limit < 1:
        raise TraceError(f"--limit {args.limit}: the number of requests to replay, at least 1")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise TraceError(f"--out {out}: not a directory; name a folder for hitrate.csv and "
                         "hitrate.png")
    if not out.exists() and not out.parent.is_dir():
        raise TraceError(f"--out {out}: its parent folder {out.parent} does not exist")
    if not Path(args.trace).is_file():
        raise TraceError(f"{args.trace}: no such file; give the path of a csv or oracleGeneral "
                         "trace")
    return kinds


def _table(stats: list[SimStats], budgets: list[tuple[str, int]], kinds: list[str],
           working_set: int, n: int, workers: int) -> list[dict[str, Any]]:
    rows = []
    print(f"{'budget':>10} {'kind':>13} {'hit ratio':>9} {'byte hits':>9} {'copied/req':>10} "
          f"{'inline':>7} {'memory':>11}")
    for i, (label, nbytes) in enumerate(budgets):
        for j, kind in enumerate(kinds):
            s = stats[i * len(kinds) + j]
            memory = nbytes * (workers if kind == "lru" else 1)
            row = {"budget": label, "budget_bytes": nbytes,
                   "budget_pct": 100 * nbytes / working_set, "kind": kind,
                   "hit_ratio": s.hit_ratio, "byte_hit_ratio": s.byte_hit_ratio,
                   "copied_bytes_per_request": s.bytes_reinserted / n, "inline": s.inline,
                   "evictions": s.evictions, "memory_bytes": memory}
            rows.append(row)
            print(f"{label:>10} {kind:>13} {s.hit_ratio:9.2%} {s.byte_hit_ratio:9.2%} "
                  f"{format_size(s.bytes_reinserted / n):>10} {s.inline:7d} {format_size(memory):>11}")
    return rows


def _frontends_table(trace: Trace, routes: list[str] | None, args: argparse.Namespace,
                     kinds: list[str], budgets: list[tuple[str, int]], shared: list[SimStats],
                     rows: list[dict[str, Any]]) -> None:
    """Replay the trace split over --frontends front ends, print shared against separate, and
    add the separate caches' hit ratio to `rows`."""
    n = args.frontends
    frontends = ([route_index(r, n) for r in routes] if routes is not None
                 else [i % n for i in range(len(trace))])
    load = np.bincount(frontends, minlength=n)
    update, done = _progress_bar(len(trace), args.no_progress, f"{n} front ends")
    try:
        separate = replay_split(trace, frontends, n, kinds, [b for _, b in budgets],
                                args.workers, update)
    finally:
        done()
    how = "by the route column" if routes is not None else "in turn"
    print(f"{n} front ends, requests {how} ({load.min():,}-{load.max():,} each): one shared "
          f"cache against {n} separate caches of the same total memory")
    print(f"{'budget':>10} {'kind':>13} {'shared':>9} {'separate':>9} {'points':>7}")
    for row, one, split in zip(rows, shared, separate):
        row["frontends"] = n
        row["separate_hit_ratio"] = split.hit_ratio
        print(f"{row['budget']:>10} {one.kind:>13} {one.hit_ratio:9.2%} {split.hit_ratio:9.2%} "
              f"{100 * (one.hit_ratio - split.hit_ratio):+7.2f}")


def verify(sample: Trace, kinds: list[str], fractions: list[float],
           max_segment: int = 32 * 2**20, progress: Callable[[int], None] | None = None) -> str:
    """Replay `sample` through the real caches in shared memory (2 readers) and through
    hitsim at each budget, given as a fraction of the sample's working set (so that the sample
    fills the cache), sizes divided so that no segment exceeds `max_segment`; say that every
    request agreed. Raises AssertionError if one did not (a bug: please report it)."""
    from ..serde._codec import encode

    working_set = working_set_bytes(sample)
    largest = max(n for _, n in sample)  # every item, and every cache, under max_segment
    scale = max(1, -(-int(max(fractions) * working_set) // max_segment),
                -(-largest // max_segment))
    scaled = [(str(k), max(1, n // scale)) for k, n in sample]
    serialized = {n: encode(np.zeros(n, np.uint8)).nbytes for _, n in scaled}
    checked = evictions = 0
    for fraction in fractions:
        capacity = max(int(fraction * working_set) // scale, 4096)
        for kind in kinds:
            sim = make_sim(kind, capacity, 2)
            expected = [sim.request(k, serialized[n]) for k, n in scaled]
            real = real_hits(kind, scaled, capacity, 2)
            first = next((i for i, (a, b) in enumerate(zip(real, expected)) if a != b), None)
            if first is not None:
                raise AssertionError(f"the replay of {kind} at {capacity} bytes differs from the "
                                     f"real cache at request {first}: please report this")
            checked += len(scaled)
            evictions += sim.stats().evictions
            if progress is not None:
                progress(len(scaled))
    return (f"verified: the first {len(sample):,} requests (sizes / {scale}, budgets as shares of "
            f"their working set) hit and miss alike in the real caches and the replay "
            f"({checked:,} requests, {evictions:,} evictions)")


def _plot(rows: list[dict[str, Any]], kinds: list[str], path: Path, target: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in kinds:
        sub = [r for r in rows if r["kind"] == kind]
        ax.plot([r["budget_pct"] for r in sub], [r["hit_ratio"] for r in sub], marker="o",
                markersize=3, label=kind)
    from matplotlib.ticker import FuncFormatter, NullFormatter, PercentFormatter

    ax.axhline(target, color="grey", linestyle="--", linewidth=1,
               label=f"target {target:.1%}")
    ax.set_xscale("log")
    percents = sorted({r["budget_pct"] for r in rows})
    ax.set_xticks(percents)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.3g}%"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, 1)
    ax.set_xlabel("cache budget (share of the working set)")
    ax.set_ylabel("requests that hit")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True



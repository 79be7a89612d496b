"""`shmstore hitrate TRACE`: the caches' hit ratios on a user's own trace, and what to run.

    shmstore hitrate requests.csv [--budgets 1%,5%,10%,25%] [--workers 8] [--target 0.6]

Reads the trace (below), replays it through every cache kind at every budget on metadata
alone (hitsim.py: the same ring, policies and LRU as the real caches; a progress bar on
stderr), checks a sample request by request against the real caches in shared memory
(`--verify N`, scaled down), prints a table, writes hitrate.csv and hitrate.png into --out,
and ends with a recommendation: the kind and budget that reach the target hit ratio, and the
memory each kind needs with N workers (an shm kind: one copy; lru: one mirror per worker).

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
import csv
import signal
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .cli import _size, parse_size
from .hitsim import SIM_KINDS, SimStats, make_sim, real_hits, replay

__all__ = ["add_arguments", "main", "read_trace", "TraceError", "recommend"]

Trace = list[tuple[Hashable, int]]
ORACLE_GENERAL = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
_NAMES = {"time": ("time", "order", "timestamp", "ts", "time-col"),
          "key": ("key", "id", "obj_id", "object", "obj-id-col"),
          "bytes": ("bytes", "size", "obj_size", "nbytes", "obj-size-col")}
DEFAULT_BUDGETS = "1%,2%,5%,10%,25%,50%"
MAX_ITEM_BYTES = 1 << 40  # 1 TiB: no cache item is larger; a bigger size is a broken trace
MAX_BUDGET_BYTES = 1 << 50  # 1 PiB
MAX_FIELD_BYTES = 1 << 17  # csv's own field limit (128 KiB), named in the error


class TraceError(ValueError):
    """The trace file cannot be read as the format says (the message names the line)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="the trace file (csv or oracleGeneral)")
    parser.add_argument("--format", choices=("csv", "oracleGeneral"), default=None)
    parser.add_argument("--columns", default=None,
                        help="csv columns, 1-based: time=1,key=2,bytes=3 (time=0: none)")
    parser.add_argument("--delimiter", default=None, help="csv delimiter (default: guessed)")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS,
                        help="cache sizes: percents of the working set or sizes (512MiB, 4GiB)")
    parser.add_argument("--kinds", default=",".join(SIM_KINDS), help="cache kinds to compare")
    parser.add_argument("--workers", type=int, default=8,
                        help="workers reading every item (the TP size)")
    parser.add_argument("--target", type=float, default=None,
                        help="hit ratio to reach (default: 90%% of an unbounded cache's)")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--verify", type=int, default=1000,
                        help="check the first N requests against the real caches (0: skip)")
    parser.add_argument("--out", default=".", help="folder for hitrate.csv and hitrate.png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


# -- reading traces -------------------------------------------------------------------------------

def read_trace(path: str | Path, fmt: str | None = None, columns: str | None = None,
               delimiter: str | None = None, limit: int | None = None) -> Trace:
    """The requests of a trace file as (key, bytes), in replay order.

    Raises:
        TraceError: the file does not parse as `fmt` (the message names the line and says
            which option to pass).
        OSError: the file cannot be read.
    """
    path = Path(path)
    if limit is not None and limit < 1:
        raise TraceError(f"--limit {limit}: replay at least 1 request (or leave it out for all)")
    if delimiter is not None and len(delimiter) != 1:
        raise TraceError(f"--delimiter {delimiter!r}: one character, such as ',' or ';' "
                         "(tab: $'\\t')")
    if fmt is None:
        fmt = "oracleGeneral" if _looks_binary(path) else "csv"
    if fmt == "oracleGeneral":
        return _read_oracle(path, limit)
    return _read_csv(path, columns, delimiter, limit)


def _looks_binary(path: Path) -> bool:
    if "oraclegeneral" in path.name.lower():
        return True
    with open(path, "rb") as f:
        head = f.read(4096)
    return b"\0" in head


def _read_oracle(path: Path, limit: int | None) -> Trace:
    size = path.stat().st_size
    if size % ORACLE_GENERAL.itemsize:
        raise TraceError(f"{path}: {size} bytes is not a whole number of {ORACLE_GENERAL.itemsize}"
                         "-byte oracleGeneral records (a compressed .zst file? decompress it "
                         "first; a csv? pass --format csv)")
    records = np.fromfile(path, dtype=ORACLE_GENERAL, count=-1 if limit is None else limit)
    return list(zip(records["id"].tolist(), records["size"].tolist()))


def _parse_columns(spec: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for part in spec.split(","):
        name, _, number = part.partition("=")
        field = next((f for f, names in _NAMES.items() if name.strip().lower() in names), None)
        if field is None or not number.strip().isdigit():
            raise TraceError(f"--columns {spec!r}: {part!r} is not NAME=NUMBER with NAME one of "
                             "time, key, bytes (1-based numbers; time=0 for none)")
        if int(number) == 0 and field != "time":
            raise TraceError(f"--columns {spec!r}: {field} must name a column (1-based); only "
                             "time=0 means none")
        found[field] = int(number) - 1
    if "key" not in found or "bytes" not in found:
        raise TraceError(f"--columns {spec!r} must give key=N and bytes=N")
    return found


def _read_csv(path: Path, columns: str | None, delimiter: str | None,
              limit: int | None) -> Trace:
    # surrogateescape: a key that is not UTF-8 is refused with its line, not a traceback
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
        first = f.readline()
        if delimiter is None:
            delimiter = next((d for d in (",", "\t", ";", " ") if d in first), ",")
        f.seek(0)
        rows = csv.reader(f, delimiter=delimiter, skipinitialspace=True)
        cols = _parse_columns(columns) if columns else None
        header = [c.strip().lower() for c in first.split(delimiter)]
        has_header = any(h in names for h in header for names in _NAMES.values())
        if has_header:
            next(rows)
            if cols is None:
                cols = {field: next(i for i, h in enumerate(header) if h in names)
                        for field, names in _NAMES.items() if any(h in names for h in header)}
        if cols is None:
            cols = {"time": 0, "key": 1, "bytes": 2} if len(header) >= 3 else {"key": 0, "bytes": 1}
        if "key" not in cols or "bytes" not in cols:
            raise TraceError(f"{path}: the header {first.strip()!r} names no key or bytes column; "
                             "pass --columns time=1,key=2,bytes=3")
        return _csv_requests(path, rows, cols, limit)


def _csv_request(path: Path, line: int, row: list[str], cols: dict[str, int],
                 times: list[float]) -> tuple[str, int]:
    """(key, bytes) of one csv row, its time appended to `times` if there is a time column."""
    key_col, bytes_col, time_col = cols["key"], cols["bytes"], cols.get("time", -1)
    try:
        key, nbytes = row[key_col], int(row[bytes_col])
        if time_col >= 0:
            times.append(float(row[time_col]))
    except (IndexError, ValueError):
        raise TraceError(f"{path}, line {line}: {row!r:.200} has no key in column "
                         f"{key_col + 1} and integer bytes in column {bytes_col + 1}; pass "
                         "--columns (and --delimiter) to say where they are") from None
    try:
        key.encode()
    except UnicodeEncodeError:
        raise TraceError(f"{path}, line {line}: the key is not UTF-8 text; convert the file to "
                         "UTF-8 (or write keys as hex)") from None
    if nbytes < 0:
        raise TraceError(f"{path}, line {line}: negative size {nbytes}")
    if nbytes > MAX_ITEM_BYTES:
        raise TraceError(f"{path}, line {line}: size {nbytes} is above {MAX_ITEM_BYTES} bytes "
                         "(1 TiB), larger than any cache item; check the bytes column (--columns)")
    return key, nbytes


def _csv_requests(path: Path, rows: Any, cols: dict[str, int], limit: int | None) -> Trace:
    trace: Trace = []
    times: list[float] = []
    try:
        for row in rows:
            if row:
                trace.append(_csv_request(path, rows.line_num, row, cols, times))
                if limit is not None and len(trace) >= limit:
                    break
    except csv.Error as exc:  # a field over MAX_FIELD_BYTES, a NUL byte, ...
        raise TraceError(f"{path}, line {rows.line_num}: {exc} (csv fields are limited to "
                         f"{MAX_FIELD_BYTES} bytes)") from None
    if times and any(b < a for a, b in zip(times, times[1:])):
        order = sorted(range(len(trace)), key=times.__getitem__)
        trace = [trace[i] for i in order]
    return trace


# -- budgets and the replay -----------------------------------------------------------------------

def parse_budgets(spec: str, working_set: int) -> list[tuple[str, int]]:
    """(label, bytes) per budget of `spec`: "5%" of the working set, or "4GiB"."""
    budgets = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            if part.endswith("%"):
                percent = float(part[:-1])
                if not 0 < percent <= 1e6:  # also nan and inf
                    raise ValueError(part)
                nbytes = int(percent * working_set / 100)
            else:
                nbytes = parse_size(part)
        except (ValueError, OverflowError):
            raise TraceError(f"--budgets: {part!r} is neither a percent (5%, up to 1000000%) nor "
                             "a size (512MiB, 4GiB)") from None
        if nbytes < 1:
            raise TraceError(f"--budgets: {part!r} is less than one byte of this trace")
        if nbytes > MAX_BUDGET_BYTES:
            raise TraceError(f"--budgets: {part!r} is {nbytes} bytes, above 1 PiB; give a "
                             "smaller budget")
        budgets.append((part, nbytes))
    return budgets


def working_set_bytes(trace: Trace) -> int:
    """The bytes of every distinct item at its largest size in the trace."""
    largest: dict[Hashable, int] = {}
    for key, nbytes in trace:
        if nbytes > largest.get(key, -1):
            largest[key] = nbytes
    return sum(largest.values())


def recommend(stats: Sequence[SimStats], target: float, workers: int) -> list[str]:
    """Lines saying, per kind, the smallest budget tried that reaches `target` and its memory,
    then the kind that needs the least memory for it."""
    lines = []
    choices: list[tuple[int, float, str, int]] = []
    for kind in dict.fromkeys(s.kind for s in stats):
        runs = sorted((s for s in stats if s.kind == kind), key=lambda s: s.capacity_bytes)
        good = next((s for s in runs if s.hit_ratio >= target), None)
        if good is None:
            lines.append(f"  {kind:<13} does not reach {target:.1%} at the budgets tried "
                         f"(best {runs[-1].hit_ratio:.1%} at {_size(runs[-1].capacity_bytes)})")
            continue
        memory = good.capacity_bytes * (workers if kind == "lru" else 1)
        where = (f"{workers} mirrors of {_size(good.capacity_bytes)}" if kind == "lru"
                 else "one shared copy")
        lines.append(f"  {kind:<13} {good.hit_ratio:.1%} at a budget of "
                     f"{_size(good.capacity_bytes)}: {_size(memory)} of memory ({where})")
        choices.append((memory, -good.hit_ratio, kind, good.capacity_bytes))
    if choices:
        memory, _, kind, budget = min(choices)
        lines.append(f"recommended: cache kind {kind} with a budget of {_size(budget)} "
                     f"({_size(memory)} of memory in all with {workers} workers)")
    else:
        lines.append("recommended: no kind reaches the target at these budgets; try larger "
                     "--budgets or a lower --target")
    return lines


def _progress_bar(total: int, disabled: bool) -> tuple[Callable[[int], None], Callable[[], None]]:
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety: pip install tqdm
        disabled = True
    if disabled:
        return (lambda n: None), (lambda: None)
    bar = tqdm(total=total, unit="req", unit_scale=True, file=sys.stderr, desc="replaying")
    return bar.update, bar.close


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)  # unwinds: the verify step closes (and unlinks) its stores


def main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        trace = read_trace(args.trace, args.format, args.columns, args.delimiter, args.limit)
        if not trace:
            raise TraceError(f"{args.trace}: no requests")
        working_set = working_set_bytes(trace)
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        bad = [k for k in kinds if k not in SIM_KINDS]
        if bad or not kinds:
            raise TraceError(f"--kinds: {bad or kinds!r}; choose from {','.join(SIM_KINDS)}")
        budgets = parse_budgets(args.budgets, working_set)
        if args.workers < 1:
            raise TraceError("--workers must be at least 1")
    except (TraceError, OSError) as exc:
        print(f"shmstore hitrate: {exc}", file=sys.stderr)
        return 2
    unique = len({k for k, _ in trace})
    infinite = 1 - unique / len(trace)
    target = args.target if args.target is not None else 0.9 * infinite
    print(f"{args.trace}: {len(trace):,} requests, {unique:,} items, working set "
          f"{_size(working_set)}, unbounded cache {infinite:.1%}; {args.workers} workers")
    t0 = time.perf_counter()
    update, done = _progress_bar(len(trace), args.no_progress)
    try:
        stats = replay(trace, kinds, [b for _, b in budgets], args.workers, update)
    finally:
        done()
    elapsed = time.perf_counter() - t0
    rows = _table(stats, budgets, kinds, working_set, len(trace), args.workers)
    print(f"replayed {len(trace) * len(stats):,} cache requests in {elapsed:.1f} s")
    if args.verify:
        print(verify(trace[:args.verify], kinds, [b / working_set for _, b in budgets]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "hitrate.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    written = [out / "hitrate.csv"]
    if _plot(rows, kinds, out / "hitrate.png"):
        written.append(out / "hitrate.png")
    print(f"for a hit ratio of {target:.1%}:")
    print("\n".join(recommend(stats, target, args.workers)))
    print("wrote " + " and ".join(str(p) for p in written))
    return 0


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
                  f"{_size(s.bytes_reinserted / n):>10} {s.inline:7d} {_size(memory):>11}")
    return rows


def verify(sample: Trace, kinds: list[str], fractions: list[float],
           max_segment: int = 32 * 2**20) -> str:
    """Replay `sample` through the real caches in shared memory (2 readers) and through
    hitsim at each budget, given as a fraction of the sample's working set (so that the sample
    fills the cache), sizes divided so that no segment exceeds `max_segment`; say that every
    request agreed. Raises AssertionError if one did not (a bug: please report it)."""
    from .serde import encode

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
    return (f"verified: the first {len(sample):,} requests (sizes / {scale}, budgets as shares of "
            f"their working set) hit and miss alike in the real caches and the replay "
            f"({checked:,} requests, {evictions:,} evictions)")


def _plot(rows: list[dict[str, Any]], kinds: list[str], path: Path) -> bool:
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
    ax.set_xscale("log")
    ax.set_xlabel("cache budget (% of the working set)")
    ax.set_ylabel("request hit ratio")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

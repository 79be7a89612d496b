"""Reading request traces for `shmstore hitrate`: csv (any column layout) and libCacheSim's
oracleGeneral, checked line by line; a bad line is a TraceError that names it."""

from __future__ import annotations

import csv
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Trace", "TraceError", "ORACLE_GENERAL", "read_trace"]

Trace = list[tuple[Hashable, int]]
ORACLE_GENERAL = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
_NAMES = {"time": ("time", "order", "timestamp", "ts", "time-col"),
          "key": ("key", "id", "obj_id", "object", "obj-id-col"),
          "bytes": ("bytes", "size", "obj_size", "nbytes", "obj-size-col"),
          "route": ("route", "frontend", "api_server", "session", "user")}
MAX_ITEM_BYTES = 1 << 40  # 1 TiB: no cache item is larger; a bigger size is a broken trace
MAX_FIELD_BYTES = 1 << 17  # csv's own field limit (128 KiB), named in the error


class TraceError(ValueError):
    """The trace file cannot be read as the format says (the message names the line)."""


def read_trace(path: str | Path, fmt: str | None = None, columns: str | None = None,
               delimiter: str | None = None, limit: int | None = None,
               routes: list[str] | None = None) -> Trace:
    """The requests of a trace file as (key, bytes), in replay order.

    With `routes`, each request's value in the route column (csv: route=N in `columns`, or a
    header named route, frontend, api_server, session or user) is appended to it, in the same
    order; TraceError if the trace has no such column.

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
        if routes is not None:
            raise TraceError(f"{path}: an oracleGeneral trace has no route column; use "
                             "--route roundrobin, or a csv trace with a route column")
        return _read_oracle(path, limit)
    return _read_csv(path, columns, delimiter, limit, routes)


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
                             "time, key, bytes, route (1-based numbers; time=0 for none)")
        if int(number) == 0 and field != "time":
            raise TraceError(f"--columns {spec!r}: {field} must name a column (1-based); only "
                             "time=0 means none")
        found[field] = int(number) - 1
    if "key" not in found or "bytes" not in found:
        raise TraceError(f"--columns {spec!r} must give key=N and bytes=N")
    return found


def _read_csv(path: Path, columns: str | None, delimiter: str | None,
              limit: int | None, routes: list[str] | None) -> Trace:
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
        if routes is not None and "route" not in cols:
            raise TraceError(f"{path}: no route column to send requests to front ends by; pass "
                             "--columns ...,route=N or use --route roundrobin")
        return _csv_requests(path, rows, cols, limit, routes)


def _csv_request(path: Path, line: int, row: list[str], cols: dict[str, int],
                 times: list[float], routes: list[str] | None) -> tuple[str, int]:
    """(key, bytes) of one csv row, its time appended to `times` if there is a time column
    and its route to `routes` if asked for."""
    key_col, bytes_col, time_col = cols["key"], cols["bytes"], cols.get("time", -1)
    try:
        key, nbytes = row[key_col], int(row[bytes_col])
        if time_col >= 0:
            times.append(float(row[time_col]))
        if routes is not None:
            routes.append(row[cols["route"]])
    except (IndexError, ValueError):
        raise TraceError(f"{path}, line {line}: {row!r:.200} has no key in column "
                         f"{key_col + 1} and integer bytes in column {bytes_col + 1}"
                         + (f" and a route in column {cols['route'] + 1}" if routes is not None else "")
                         + "; pass --columns (and --delimiter) to say where they are") from None
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


def _csv_requests(path: Path, rows: Any, cols: dict[str, int], limit: int | None,
                  routes: list[str] | None) -> Trace:
    trace: Trace = []
    times: list[float] = []
    try:
        for row in rows:
            if row:
                trace.append(_csv_request(path, rows.line_num, row, cols, times, routes))
                if limit is not None and len(trace) >= limit:
                    break
    except csv.Error as exc:  # a field over MAX_FIELD_BYTES, a NUL byte, ...
        raise TraceError(f"{path}, line {rows.line_num}: {exc} (csv fields are limited to "
                         f"{MAX_FIELD_BYTES} bytes)") from None
    if times and any(b < a for a, b in zip(times, times[1:])):
        order = sorted(range(len(trace)), key=times.__getitem__)
        trace = [trace[i] for i in order]
        if routes is not None:
            routes[:] = [routes[i] for i in order]
    return trace

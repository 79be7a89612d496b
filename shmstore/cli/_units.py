"""Sizes and ages as the command line reads and prints them."""

from __future__ import annotations

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes in a size such as "512MiB", "4G" or "1000" (ValueError if it is not one)."""
    number = text.strip().rstrip("kKmMgGtTiIbB")
    unit = text.strip()[len(number):].lower()
    if unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size such as 512MiB or 4G")
    return int(float(number) * _UNITS[unit])


def format_size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)  # pragma: no cover


def format_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"

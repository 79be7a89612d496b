"""Waiting in tests for what a test checks, never for a fixed time (CI machines are shared)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> None:
    """Poll `predicate` until it is true; AssertionError naming `what` after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)

"""Runs last (conftest moves it there): every test, example and process before it cleaned up
/dev/shm.

The session hook in conftest.py checks once more after the very last test."""

from __future__ import annotations

import os

import pytest

from tests.conftest import leftover_segments


def test_no_segment_or_semaphore_left_behind() -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the other process may still be at its tests
        pytest.skip("run on several processes: the session's end checks, once all are done")
    assert leftover_segments() == []

"""Runs last (conftest moves it there): every test, example and process before it cleaned up
/dev/shm.

The session hook in conftest.py checks once more after the very last test."""

from __future__ import annotations

from tests.conftest import leftover_segments


def test_no_segment_or_semaphore_left_behind() -> None:
    assert leftover_segments() == []

"""Make one method of an object raise once, as a signal handler's exception would stop it."""

from __future__ import annotations

from typing import Any

import pytest


class Stop(Exception):
    """What the patched method raises."""


def stop_at_call(monkeypatch: pytest.MonkeyPatch, target: Any, name: str, at: int) -> list[int]:
    """Patch `target.name` to raise Stop at its `at`-th call and work as before otherwise;
    return the one-item list that counts the calls."""
    real = getattr(target, name)
    calls = [0]

    def once(*args: object) -> object:
        calls[0] += 1
        if calls[0] == at:
            raise Stop
        return real(*args)

    monkeypatch.setattr(target, name, once)
    return calls

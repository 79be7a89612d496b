"""Process facts the layers share: is a pid alive, and has this process forked since?

Pids read from shared memory are untrusted: anything outside 1..PID_MAX_LIMIT is reported as
"no such process" instead of reaching os.kill (which raises OverflowError on large values).
"""

from __future__ import annotations

import operator
import os
from typing import Any

from .errors import InvalidArgument

__all__ = ["MAX_SECONDS", "PID_MAX_LIMIT", "pid_alive", "proc_stat", "threads_left",
           "fork_generation", "int_arg", "number_arg"]

MAX_SECONDS = 1e12  # the largest timeout taken (about 31,700 years): larger is a mistake
PID_MAX_LIMIT = 1 << 22  # Linux's hard ceiling for pid_max (4194304); larger pids cannot exist

_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_generation() -> int:
    """A number that changes in a child each time this process forks."""
    return _fork_generation


def pid_alive(pid: int) -> bool:
    """Say whether a process with this pid exists (in this pid namespace); False for pids that
    cannot exist (damaged words)."""
    if not 0 < pid <= PID_MAX_LIMIT:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    stat = proc_stat(pid)  # a zombie (killed, not yet reaped by its parent) holds nothing
    return stat is None or stat[0] not in ("Z", "X") or threads_left(pid)


def threads_left(pid: int) -> bool:
    """Whether process `pid`'s leader thread has ended while other threads of it run or still
    exit (a SIGKILLed process tearing down a large address space, or a leader that called
    pthread_exit): /proc shows the leader a zombie, yet the process holds its descriptors,
    locks and mappings until its last thread is gone."""
    try:
        return any(tid != str(pid) for tid in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return False


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of process `pid` from /proc, or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()  # after the command name
        return fields[0].decode("ascii"), int(fields[1])
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None


def int_arg(value: Any, argument: str, low: int, high: int) -> int:
    """Return `value` as an int in [low, high] (numpy ints accepted, bools not).

    Raises:
        InvalidArgument: naming the argument, its range and what was given.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{argument} must be an int in [{low}, {high}], got "
                              f"{type(value).__name__} {value!r:.60}", argument, value) from None
    if not low <= number <= high:
        raise InvalidArgument(f"{argument} must be an int in [{low}, {high}], got {number}",
                              argument, value)
    return number


def number_arg(value: Any, argument: str, *, allow_none: bool) -> float | None:
    """Return a non-negative finite number of seconds (or None where allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < MAX_SECONDS:
        none = " or None (wait without limit)" if allow_none else ""
        raise InvalidArgument(f"{argument} must be a number of seconds >= 0{none}, got "
                              f"{value!r:.60}", argument, value)
    return float(value)


def seconds_arg(value: Any, argument: str) -> float:
    """Return a positive finite number of seconds."""
    seconds = number_arg(value, argument, allow_none=False)
    if not seconds:
        raise InvalidArgument(f"{argument} must be more than 0 seconds, got {value!r}",
                              argument, value)
    return float(seconds)


def env_seconds(name: str, default: float) -> float:
    """Seconds from the environment variable `name` (a positive number), `default` if unset;
    InvalidArgument naming the variable otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value: Any = float(raw)
    except ValueError:
        value = raw
    return seconds_arg(value, name)


_SWITCH = {"1": True, "true": True, "on": True, "yes": True,
           "0": False, "false": False, "off": False, "no": False}


def env_switch(name: str, default: bool) -> bool:
    """A yes/no environment variable: 0/1, false/true, off/on, no/yes (any case); unset or
    empty: `default`.

    Raises:
        InvalidArgument: anything else, naming the variable.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = _SWITCH.get(raw.strip().lower())
    if value is None:
        raise InvalidArgument(f"{name}={raw!r} is not a switch: set it to 1, true or on, or to "
                              "0, false or off (or unset it)", name, raw)
    return value

"""The miss pool's words, shared by the pool, its workers, its host and its clients: the
typed Outcome of one item (its values the wire's words and the metrics' labels), what a job
may hold (check_job), how a worker processes one item (Processor), the pool's stats, and the
Pool protocol the local pool and a client of the node's both meet."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from ..errors import InvalidArgument

__all__ = ["Outcome", "STORED", "FALLBACKS", "check_job", "Processor", "PoolStats", "Pool"]


class Outcome(str, Enum):
    """What became of one submitted item: STORED, or why the caller processes it itself. The
    values are the wire's words and the metrics' labels."""

    __hash__ = str.__hash__  # a dict keyed by the words finds the members, and back
    __str__ = str.__str__

    STORED = "stored"  # the item is in the store (processed by the pool, or by another meanwhile)
    FAILED = "failed"  # the processor raised (or the job could not be read)
    DECLINED = "declined"  # the processor does not take this job
    DIED = "died"  # its worker died, or was stopped over the time limit
    FULL = "full"  # more than max_waiting jobs queued
    STARTING = "starting"  # no worker is ready yet
    STORE_FULL = "store_full"  # the value does not fit the store now
    UNAVAILABLE = "unavailable"  # the pool is broken, or no pool serves the node
    CLOSED = "closed"  # the pool (or the client) was closed
    TIMEOUT = "timeout"  # the caller's own: it gave up waiting


STORED = Outcome.STORED
FALLBACKS = tuple(o for o in Outcome if o is not STORED)
MAX_JOB_DEPTH = 16  # nesting of a job's lists and maps


def check_job(job: Any, depth: int = 0) -> None:
    """Raise InvalidArgument unless `job` is what a worker can read back: msgpack's types
    (None, bool, int, float, str, bytes, lists and tuples, maps with str keys), nested at most
    MAX_JOB_DEPTH deep. Checked where it is submitted, so a worker never meets a job it cannot
    read."""
    if depth > MAX_JOB_DEPTH:
        raise InvalidArgument(f"a miss pool job nests deeper than {MAX_JOB_DEPTH} levels",
                              "job", None)
    if job is None or isinstance(job, (bool, int, float, str, bytes, bytearray)):
        return
    if isinstance(job, (list, tuple)):
        for part in job:
            check_job(part, depth + 1)
        return
    if isinstance(job, dict):
        for key, part in job.items():
            if not isinstance(key, str):
                raise InvalidArgument(
                    f"a miss pool job's map keys must be str, not {type(key).__name__} "
                    f"({key!r:.40}): convert them, or process the item where it is", "job",
                    None)
            check_job(part, depth + 1)
        return
    raise InvalidArgument(f"a miss pool job must be msgpack data, not {type(job).__name__}: "
                          "send bytes, numbers, strings, lists and maps with str keys", "job",
                          None)


@dataclass(frozen=True)
class Processor:
    """How a worker processes one item: `factory` ("module:function") is called once in the
    worker with `args` (sent at spawn, so picklable) and returns process(job) -> value, or None
    for a job it does not take (the caller processes it: "declined"). An exception from
    process is the "failed" outcome, with its message."""

    factory: str
    args: tuple[Any, ...] = ()

    def build(self) -> Callable[[Any], Any]:
        module, _, name = self.factory.partition(":")
        return getattr(importlib.import_module(module), name)(*self.args)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class PoolStats:
    """The pool now: workers (ready, busy, starting), jobs queued, and counts since it started:
    submitted (jobs sent to a worker), processed (jobs a worker ran the processor for: not
    those it found stored already), stored, waited (a key already in flight: single flight),
    fallback (by reason), restarts (workers started again after dying)."""

    workers: int
    ready: int
    busy: int
    queued: int
    submitted: int
    processed: int
    stored: int
    waited: int
    restarts: int
    fallback: dict[str, int] = field(default_factory=dict)


class Pool(Protocol):
    """What an API server submits its misses to: the local MissPool or a PoolClient of the
    node's. `waited` counts the answers whose key was in flight already, on both."""

    waited: int

    def join(self, key: str, job: Any) -> tuple[Future[Outcome], bool]: ...

    def submit(self, key: str, job: Any) -> Future[Outcome]: ...

    def close(self) -> None: ...

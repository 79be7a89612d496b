"""The store's side of a miss pool, in the writer's own process: "is this key stored?" and the
chunks each worker writes an item into (store/_lender.py), lent and published through the
worker's own pipe (serving/_crew.py) with no store host between them.

    worker                                   the pool's dispatcher (the writer's process)
      value = process(job); encode it
      ["begin", key, nbytes, crc]  ----->      Lending.begin: room in the ring, under the
                                   <-----      writer's lock: ["lent", loan, offset]
                                               (or ["refused", outcome, why])
      writes the body into the ring
      ["done", "stored", ""]       ----->      Lending.commit: published, owed by no reader
                                               (any other end: the chunk is given back)

A worker that dies or is stopped with a chunk lent has it given back (close): an orphan the
ring frees when it reaches it, never a published object half written.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..errors import KeyExists, ObjectTooLarge, ShmStoreError, StoreFull
from ..store._lender import Lender
from ..store._writer import StoreWriter
from ._outcome import STORED, Outcome

__all__ = ["PoolStore", "Lending", "ANOTHER", "LENT", "REFUSED"]

ANOTHER = "stored by another meanwhile"  # a STORED answer's detail: the key was put meanwhile
LENT, REFUSED = "lent", "refused"  # the first word of the dispatcher's answer to a begin


class PoolStore(Protocol):
    """What a miss pool needs of the store it fills, in its own process (serving/_deployment.py
    Writers meets it): its name and epoch, "is this key stored now?" (an answer that may be
    "no" when it cannot be had at once), and a Lending per worker."""

    @property
    def name(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    def stored(self, key: str) -> bool: ...

    def lending(self) -> Lending: ...


class Lending:
    """The chunks one worker writes into: each call under the writer's `lock` (held only for
    the store's own bookkeeping: a chunk is found, never copied, here)."""

    def __init__(self, writer: StoreWriter, lock: Any) -> None:
        self._lender = Lender(writer)
        self._lock = lock

    def begin(self, key: str, nbytes: int, crc: int) -> list[Any]:
        """The answer to a worker's begin: ["lent", loan, offset], or ["refused", outcome,
        why] (the key was stored meanwhile: STORED; no room: STORE_FULL; a bad request:
        FAILED)."""
        if not (isinstance(key, str) and type(nbytes) is int and type(crc) is int
                and nbytes >= 0 and 0 <= crc < 1 << 32):
            return [REFUSED, Outcome.FAILED.value, "a malformed begin"]
        try:
            with self._lock:
                loan, offset = self._lender.begin(key, nbytes, crc)
        except KeyExists:
            return [REFUSED, STORED.value, ANOTHER]
        except (StoreFull, ObjectTooLarge) as exc:
            return [REFUSED, Outcome.STORE_FULL.value, str(exc)]
        except (ShmStoreError, ValueError) as exc:
            return [REFUSED, Outcome.FAILED.value, f"{type(exc).__name__}: {exc}"]
        return [LENT, loan, offset]

    def end(self, loan: int, outcome: Outcome, detail: str) -> tuple[Outcome, str]:
        """The worker's job on chunk `loan` ended with `outcome`: a STORED body is published
        (owed by no reader), any other end gives the chunk back; the job's final outcome."""
        try:
            with self._lock:
                if outcome is not STORED:
                    self._lender.abandon(loan)
                    return outcome, detail
                self._lender.commit_unowed(loan)
        except KeyExists:  # put by another meanwhile: the chunk was given back
            return STORED, ANOTHER
        except (ShmStoreError, KeyError) as exc:
            return Outcome.FAILED, f"{type(exc).__name__}: {exc}"
        return outcome, detail

    def close(self) -> None:
        """Give back every chunk still lent (the worker is gone); idempotent."""
        with self._lock:
            self._lender.close()

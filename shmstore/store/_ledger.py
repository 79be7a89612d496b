"""The writer's reading of the reader rows: what each reader owes on an object, and who is
inside a chunk (store/_layout.py draws the words; readers write them, the writer only loads)."""

from __future__ import annotations

from ..shm._ordering import Words
from ..shm._readers import ATTACHED, NEVER, Liveness, ReaderTable
from ._layout import (
    COUNT_MASK,
    MAX_PINS,
    ROW_ATTACH_HANDOUT,
    ROW_DONE_THROUGH,
    ROW_PIN_MASK,
    ROW_PINS,
    counter_offset,
)

__all__ = ["ReaderLedger"]


class ReaderLedger:
    """The writer's reading of the reader rows: what each reader still owes on an object (its
    counter against the hand-outs made after it attached) and which readers are inside a chunk
    (its pins). Readers write these words; the writer only loads them."""

    def __init__(self, words: Words, table: ReaderTable, liveness: Liveness) -> None:
        self._words = words
        self._table = table
        self._liveness = liveness
        self._n = self.n_readers = table.n_readers

    def owed(self, handouts: list[int], address: int, force: bool,
             narrowed: dict[int, int] | None = None) -> list[int]:
        """Reads each reader still owes on the object at `address`, handed out as numbered;
        a hand-out in `narrowed` is owed only by the readers of its mask (bit r: reader r)."""
        n = self._n
        if not handouts:
            return [0] * n
        words = self._words
        table = self._table
        owed = [0] * n
        every = handouts
        for r in range(n):
            if narrowed:
                handouts = [h for h in every if h not in narrowed or narrowed[h] >> r & 1]
                if not handouts:
                    continue
            status, generation = self._liveness.status(r, force)
            if status == NEVER:
                owed[r] = len(handouts)
                continue
            if status != ATTACHED:
                continue
            row = table.row(r)
            after = words.load_acquire(row + ROW_ATTACH_HANDOUT)
            through = words.load_acquire(row + ROW_DONE_THROUGH)
            if through:  # an in-order reader: what comes after `through` is owed, once each
                owed[r] = sum(h > after and h > through for h in handouts)
                continue
            count = len(handouts) if handouts[0] > after else sum(h > after for h in handouts)
            if count:
                word = words.load_acquire(counter_offset(address, r))
                reads = word & COUNT_MASK if word >> 32 == generation else 0
                owed[r] = max(0, count - reads)
        return owed

    def pinned_by(self, seq: int) -> tuple[int, ...]:
        """Attached readers that are inside the chunk `seq` now."""
        words = self._words
        table = self._table
        inside = []
        for r in range(self._n):
            row = table.row(r)
            mask = words.load_acquire(row + ROW_PIN_MASK)
            if not mask:
                continue
            if self._liveness.status(r)[0] != ATTACHED:
                continue
            for i in range(MAX_PINS):
                if mask >> i & 1 and words.load_acquire(row + ROW_PINS + 8 * i) == seq:
                    inside.append(r)
                    break
        return tuple(inside)

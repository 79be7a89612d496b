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
    ROW_TOTAL_READS,
    counter_offset,
)

__all__ = ["ReaderLedger", "Row"]

Row = tuple[int, int, int, int, int]  # ReaderLedger.rows: status, generation, after, through, reads


class ReaderLedger:
    """The writer's reading of the reader rows: what each reader still owes on an object (its
    counter against the hand-outs made after it attached) and which readers are inside a chunk
    (its pins). Readers write these words; the writer only loads them."""

    def __init__(self, words: Words, table: ReaderTable, liveness: Liveness) -> None:
        self._words = words
        self._table = table
        self._liveness = liveness
        self._n = self.n_readers = table.n_readers

    def rows(self, force: bool) -> list[Row]:
        """Per reader, what owed() needs of its row now: (status, generation, the last
        hand-out before it attached, the hand-out it is done through in order, its reads
        ever). The reads are loaded first: a reader counts a read on the object, then in its
        row, so an object's counter loaded after them is at least as new (the scrape's
        stamp of a reader, store/_space.py)."""
        words = self._words
        table = self._table
        rows = []
        for r in range(self._n):
            status, generation = self._liveness.status(r, force)
            if status == ATTACHED:
                row = table.row(r)
                reads = words.load_acquire(row + ROW_TOTAL_READS)
                rows.append((status, generation, words.load_acquire(row + ROW_ATTACH_HANDOUT),
                             words.load_acquire(row + ROW_DONE_THROUGH), reads))
            else:
                rows.append((status, generation, 0, 0, 0))
        return rows

    def owed(self, handouts: list[int], address: int, force: bool,
             narrowed: dict[int, int] | None = None,
             rows: list[Row] | None = None, only: int | None = None) -> list[int]:
        """Reads each reader still owes on the object at `address`, handed out as numbered;
        a hand-out in `narrowed` is owed only by the readers of its mask (bit r: reader r).
        `rows` (from rows()) saves reading the rows again for each of many objects; `only`:
        reader `only`'s alone (the others' are 0)."""
        n = self._n
        if not handouts:
            return [0] * n
        if rows is None:
            rows = self.rows(force)
        load = self._words.load_acquire
        base = counter_offset(address, 0)  # reader r's counter is 8 r bytes on
        owed = [0] * n
        every = handouts
        for r, (status, generation, after, through, _) in (
                enumerate(rows) if only is None else ((only, rows[only]),)):
            if narrowed:
                handouts = [h for h in every if h not in narrowed or narrowed[h] >> r & 1]
                if not handouts:
                    continue
            if status != ATTACHED:
                if status == NEVER:
                    owed[r] = len(handouts)
                continue
            if through:  # an in-order reader: what comes after `through` is owed, once each
                owed[r] = sum(h > after and h > through for h in handouts)
                continue
            count = len(handouts) if handouts[0] > after else sum(h > after for h in handouts)
            if count:
                word = load(base + 8 * r)
                reads = word & COUNT_MASK if word >> 32 == generation else 0
                if count > reads:
                    owed[r] = count - reads
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

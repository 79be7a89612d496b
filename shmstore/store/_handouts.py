"""The writer's hand-outs: numbering them, giving them back, narrowing them to some readers,
ending them, and withdrawing their objects (store/_writer.py has the picture of hand-outs and
reads, and the exception-safety rules every method here keeps). HandOuts owns the hand-out
sequence; StoreWriter holds the guard of every call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .._proc import int_arg
from ..errors import StaleHandle
from ..handle import Handle, HandOut
from ..shm._ordering import Words
from ..shm._readers import check_reader_index
from ._index import Entry, Index
from ._layout import U64
from ._space import Space

__all__ = ["HandOuts", "object_id"]

_new = tuple.__new__


class HandOuts:
    """Hand-outs of live objects, and taking them back."""

    def __init__(self, index: Index, space: Space, words: Words, seq_offset: int, *,
                 name: str, n_readers: int, check_handle: Callable[[Handle], None]) -> None:
        self._index = index
        self._space = space
        self._words = words
        self._seq_offset = seq_offset  # the store meta word readers read the last number from
        self.name = name
        self.n_readers = n_readers
        self._check_handle = check_handle
        self.seq = 0  # the number of the last hand-out
        self.give_backs = 0

    def give_back(self, handle: Handle, number: int | None = None) -> None:
        """Take back hand-out `number` of `handle` (else its last); StoreWriter.give_back says more."""
        if number is not None:
            number = int_arg(number, "number", -(1 << 63), (1 << 64) - 1)
        entry = self._handed_out(handle)
        if number is not None and number not in entry.handouts:
            raise StaleHandle(f"handle {handle} has no hand-out number {number} to give back in "
                              f"store {self.name!r}; give each hand-out back at most once",
                              handle, self.name)
        self.give_backs += 1
        if number is None:
            number = entry.handouts[-1]
        self._index.changing(entry)
        entry.narrowed.pop(number, None)
        entry.ended.discard(number)
        entry.handouts.remove(number)  # last: if this line ran, the give-back is done

    def narrow(self, handle: Handle, number: int, readers: Iterable[int]) -> None:
        """Owe hand-out `number` of `handle` only by `readers`; StoreWriter.narrow says more."""
        number = int_arg(number, "number", -(1 << 63), (1 << 64) - 1)
        entry = self.live_entry(handle)
        mask = 0
        for r in readers:
            mask |= 1 << check_reader_index(r, self.n_readers, f"store {self.name!r}")
        if number not in entry.handouts:
            raise StaleHandle(f"handle {handle} has no hand-out number {number} in store "
                              f"{self.name!r}", handle, self.name)
        with self._index.lock:  # a scrape sees the new mask with the entry marked
            self._index.handed_out(entry)
            entry.narrowed[number] = mask

    def end_handouts(self, groups: Iterable[tuple[Handle, Iterable[int]]]) -> list[bool]:
        """Mark hand-outs over; StoreWriter.end_handouts says more."""
        owed = []
        for handle, numbers in groups:
            try:
                entry = self.live_entry(handle)
            except StaleHandle:
                owed.append(False)
                continue
            made = set(entry.handouts)
            entry.ended.update(n for n in numbers if n in made)
            owed.append(any(self._space.owed(entry, force=False)))
        return owed

    def unread(self, handle: Handle) -> tuple[int, ...]:
        """Reads each reader still owes on the object of `handle`; no side effect."""
        return tuple(self._space.owed(self.live_entry(handle), force=False))

    def withdraw(self, handle: Handle) -> bool:
        """Drop the object of `handle` now (False if it is gone); StoreWriter.withdraw says more."""
        try:
            entry = self.live_entry(handle)
        except StaleHandle:
            return False
        self._space.withdraw(entry)
        return True

    def hand_out(self, handle: Handle, done: list[tuple[Entry, int]]) -> HandOut:
        """Hand the object of `handle` out once more."""
        return self.make(self.live_entry(handle), done)

    def hand_out_again(self, handle: Handle) -> HandOut:
        """Renumber the last hand-out of `handle` as one made now; StoreWriter.hand_out_again says more."""
        entry = self._handed_out(handle)
        number = self.seq + 1
        with self._index.lock:  # a scrape sees the new number with the entry marked
            self._index.handed_out(entry)
            entry.handouts[-1] = number  # one store: the kept hand-out becomes this one
        self._advance(number)
        return HandOut(entry.handle, number, object_id(entry))

    def live_entry(self, handle: Handle) -> Entry:
        """The live entry of `handle` (indexed or kept by clear for its readers); StaleHandle
        if none."""
        self._check_handle(handle)
        entry = self._index.by_seq.get(handle.seq)
        if entry is None or not entry.live or entry.handle != handle:
            raise StaleHandle(f"handle {handle} names no live object in store {self.name!r}; "
                              "it was reclaimed or cleared already", handle, self.name)
        return entry

    def _handed_out(self, handle: Handle) -> Entry:
        """The live entry of `handle` with a hand-out to take back; StaleHandle if none."""
        entry = self.live_entry(handle)
        if not entry.handouts:
            raise StaleHandle(f"handle {handle} has no hand-out left to give back in store "
                              f"{self.name!r}; give each hand-out back at most once",
                              handle, self.name)
        return entry

    def make(self, entry: Entry, done: list[tuple[Entry, int]],
             record: bytes | None = None) -> HandOut:
        """Hand `entry` out once (listed in `done`, which the caller undoes if it fails)."""
        number = self.seq + 1
        done.append((entry, number))
        with self._index.lock:  # a scrape sees the new number with the entry marked
            self._index.handed_out(entry)  # first: marked in vain costs a scrape one look
            entry.handouts.append(number)
        self._advance(number)
        # tuple.__new__: a HandOut without the Python-level __new__ of a named tuple (a hit
        # makes one every time)
        return _new(HandOut, (entry.handle, number, entry.object_id or object_id(entry), record))

    def _advance(self, number: int) -> None:
        self.seq = number
        # Full barrier: a reader attaching now publishes its row, then reads this number; one of
        # the two sides sees the other (see store.StoreReader attach).
        self._words.exchange(self._seq_offset, number)

    def undo(self, done: list[tuple[Entry, int]]) -> None:
        """Take back hand-outs whose handle never reached the caller."""
        for entry, number in done:
            if number in entry.handouts:
                with self._index.lock:
                    self._index.handed_out(entry)
                    entry.narrowed.pop(number, None)
                    entry.handouts.remove(number)


def object_id(entry: Entry) -> bytes:
    """The id of `entry`'s bytes (HandOut.object_id): its key digest and origin seq (kept in the
    entry once made: a hit makes a HandOut every time)."""
    oid = entry.object_id
    if not oid:
        oid = entry.object_id = entry.handle.key_digest + U64.pack(entry.origin)
    return oid

"""Chunks of one writer lent to another process (store/_host.py): it writes an object's body
straight into shared memory, then the host publishes it."""

from __future__ import annotations

from ..handle import Handle, HandOut, check_key
from ..shm._segment import ALIGN_BYTES
from ._index import Entry
from ._writer import StoreWriter

__all__ = ["Lender"]


class Lender:
    """Chunks of one writer lent to another process, which writes an object's body straight
    into shared memory (store/_host.py): `begin` makes room and writes the object header,
    `commit` publishes the object, `abandon` gives the room back. Only a WriterHost holds
    one, per client connection, and calls it with the host's lock held; close() gives back
    what is still lent (the client went away)."""

    def __init__(self, writer: StoreWriter) -> None:
        self._writer = writer
        self._loans: dict[int, Entry] = {}  # loan number (the chunk's seq) -> its entry

    def __len__(self) -> int:
        return len(self._loans)

    def __contains__(self, loan: int) -> bool:
        return loan in self._loans

    def begin(self, key: str | bytes, nbytes: int, structure_crc: int) -> tuple[int, int]:
        """Room for an object of `nbytes` serialized bytes (with `structure_crc`): (the loan's
        number, the byte offset in the segment where its body goes).

        Raises:
            KeyExists, ObjectTooLarge, StoreFull: as put() with timeout 0.
        """
        w = self._writer
        check_key(key)
        with w._call():
            entry = w._begin(key, _Sized(nbytes, structure_crc), 0)
            self._loans[entry.chunk.seq] = entry  # first: close() finds whatever is reserved
            entry.reserved = True  # another process writes into it: not reclaimable
        return entry.chunk.seq, entry.chunk.address + ALIGN_BYTES + w._header_bytes

    def commit(self, loan: int) -> tuple[str | bytes, HandOut]:
        """Publish lent object `loan` once its body is written: index it and hand it out
        once; (its key, the hand-out).

        Raises:
            KeyError: no such loan.
            KeyExists: the key was put meanwhile (the room is given back).
        """
        entry = self._loans[loan]
        try:
            handout = self._writer._publish(entry)
        except BaseException:
            entry.reserved = False
            self._loans.pop(loan, None)
            raise
        self._loans.pop(loan, None)  # committed: no longer reserved (close() may still see it)
        return entry.key, handout

    def commit_unowed(self, loan: int) -> Handle:
        """commit, and its hand-out given back in the same step: the object is cached and no
        reader owes it, whatever becomes of the process that wrote it. Raises as commit."""
        handout = self.commit(loan)[1]
        self._writer.give_back(handout.handle, handout.number)
        return handout.handle

    def abandon(self, loan: int) -> None:
        """Give the room of `loan` back (KeyError: no such loan): an orphan chunk now, freed
        when the ring reaches it."""
        self._loans.pop(loan).reserved = False

    def close(self) -> None:
        """Give back every chunk still lent; idempotent."""
        loans, self._loans = self._loans, {}
        for entry in loans.values():
            entry.reserved = False


class _Sized:
    """What _begin needs of an Encoded for a body written elsewhere."""

    __slots__ = ("nbytes", "structure_crc")

    def __init__(self, nbytes: int, structure_crc: int) -> None:
        self.nbytes = nbytes
        self.structure_crc = structure_crc

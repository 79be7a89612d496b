"""The writer's records of its objects: one Entry each, found by key and by chunk seq (the
writer's own memory; store/_writer.py has the exception-safety rules every change keeps)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..handle import Handle, check_key
from ..shm._ring import Chunk

__all__ = ["Entry", "Index"]


@dataclass(slots=True, eq=False)
class Entry:
    """The writer's record of one object."""

    key: str | bytes
    handle: Handle
    chunk: Chunk
    nbytes: int  # serialized body size
    crc: int  # structure CRC as written
    handouts: list[int] = field(default_factory=list)  # hand-out numbers not yet taken back
    uses: int = 0  # the policy's use count (hits since written, as the policy counts them)
    live: bool = True  # False once dropped (also mid-drop, if an exception cut it short)
    reserved: bool = False  # being filled by an open reserve(): neither live nor reclaimable
    origin: int = 0  # seq of the put that wrote these bytes (the header's origin_seq)
    ended: set[int] = field(default_factory=set)  # hand-outs whose users said they are over
    narrowed: dict[int, int] = field(default_factory=dict)  # hand-out -> mask of its readers
    object_id: bytes = b""  # key digest + origin seq (HandOut.object_id), set when it is made


class Index:
    """`by_key`: the entry each key names now. `by_seq`: every live entry by its chunk's seq,
    also one that clear(keep_handed_out=True) kept for its readers and no key names.
    `changed`: the entries of `by_seq` whose hand-outs changed since the last `stats()` took
    them (handed out, given back, narrowed, renumbered), and the seqs that entries the scrape
    keeps (`kept`) left (dropped, or copied elsewhere): what the scrape must look at again
    (store/_space.py Scrape). The writer marks an entry under `lock`, before the change, in the
    same hold: a scrape that takes the marks then either sees the change or finds the entry
    marked again. Both stay as small as the live entries, scraped or not. `last`: the entry
    marked by `changing`, whose change may still be under way."""

    __slots__ = ("by_key", "by_seq", "changed", "kept", "last", "lock")

    def __init__(self) -> None:
        self.by_key: dict[str | bytes, Entry] = {}
        self.by_seq: dict[int, Entry] = {}
        self.changed: dict[int, Entry] = {}
        self.kept: set[int] = set()  # seqs of the entries the scrape keeps as owing reads
        self.last: tuple[int, Entry] | None = None
        self.lock = threading.RLock()  # a signal handler's stats() in the writer's thread

    def handed_out(self, entry: Entry) -> None:
        """`entry`'s hand-outs change now (the caller holds `lock` from here until the change
        is recorded in the entry)."""
        self.changed[entry.chunk.seq] = entry

    def changing(self, entry: Entry) -> None:
        """`entry`'s hand-outs change next, in what must be the caller's last statement (a
        give-back's commit point, so no lock is held around it): marked now, and looked at by
        every scrape (`last`) until the next change is marked, when this one is done and is
        marked again."""
        last = self.last
        if last is not None:
            self.changed[last[0]] = last[1]
        self.last = (entry.chunk.seq, entry)
        self.changed[entry.chunk.seq] = entry

    def forget(self, seq: int, entry: Entry) -> None:
        """`entry` no longer lives at chunk `seq` (dropped, or copied elsewhere)."""
        with self.lock:
            if seq in self.kept:
                self.changed[seq] = entry  # the scrape lets it go
            else:
                self.changed.pop(seq, None)  # never kept: nothing to let go
            if self.by_seq.get(seq) is entry:
                del self.by_seq[seq]

    def lookup(self, key: str | bytes, *, checked: bool = False) -> Entry | None:
        """The live entry of `key` (InvalidKey for a key that is not one, unless the caller
        `checked` it already), None if none."""
        if not checked:
            check_key(key)
        entry = self.by_key.get(key)
        if entry is not None and not entry.live:
            del self.by_key[key]  # left by a drop an exception cut short
            return None
        return entry

    def names(self, entry: Entry) -> bool:
        """Whether `entry` is what its key names (not an object clear kept for its readers)."""
        return self.by_key.get(entry.key) is entry

    def drop(self, entry: Entry) -> None:
        entry.live = False  # first: lookups now ignore it, whatever happens next
        if self.names(entry):
            del self.by_key[entry.key]
        self.forget(entry.chunk.seq, entry)

    def __len__(self) -> int:
        return sum(1 for e in self.by_key.values() if e.live)

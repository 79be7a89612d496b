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
    outs: int = 0  # hand-outs made and narrowings, ever: the scrape's way to see one while it looked
    object_id: bytes = b""  # key digest + origin seq (HandOut.object_id), set when it is made


class Index:
    """`by_key`: the entry each key names now. `by_seq`: every live entry by its chunk's seq,
    also one that clear(keep_handed_out=True) kept for its readers and no key names.
    `unread`: the entries of `by_seq` handed out since `stats()` last found every read of them
    done, the only ones that can owe a read to an attached reader (reads only ever lower what
    is owed; only the writer raises it, by handing out). The writer adds and drops entries, a
    scrape in another thread removes the settled ones; both under `lock`."""

    __slots__ = ("by_key", "by_seq", "lock", "unread")

    def __init__(self) -> None:
        self.by_key: dict[str | bytes, Entry] = {}
        self.by_seq: dict[int, Entry] = {}
        self.unread: dict[int, Entry] = {}
        self.lock = threading.RLock()  # a signal handler's stats() in the writer's thread

    def handed_out(self, entry: Entry) -> None:
        """`entry` may owe reads from now on (a hand-out, or a narrowing to more readers). The
        caller holds `lock` from here until the change is recorded in the entry: a scrape that
        looks at `entry` then sees both or neither."""
        entry.outs += 1
        self.unread[entry.chunk.seq] = entry

    def forget(self, seq: int, entry: Entry) -> None:
        """`entry` no longer lives at chunk `seq` (dropped, or copied elsewhere)."""
        if self.by_seq.get(seq) is entry:
            del self.by_seq[seq]
        if self.unread.get(seq) is entry:
            with self.lock:
                self.unread.pop(seq, None)

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

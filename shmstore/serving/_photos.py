"""A miss's photo by shared memory: the API server that received it writes its original bytes
once into a ring of its own (PhotoOutbox); the pool's message carries a reference of four
words, not megabytes; the worker that takes the job reads the bytes there (read_photo).

    API server (any)                               pool worker
      PhotoOutbox.put(data) -> ref                   read_photo(ref) -> bytes
        one copy into a chunk of its ring              the ring attached by name, once
        ref: [ring name, address, seq, size]           header checked (seq, size, check word),
      the job's outcome comes back -> done(ref)        bytes copied out, the seq checked again:
        chunks freed oldest first, once every           a chunk freed meanwhile is StaleHandle,
        older job has come back                         never other bytes

A chunk is freed only after its job's outcome arrived (the worker is done with it, or dead,
or never got it); a reference that outlives its chunk (a job answered "unavailable" on a
dropped connection, then run) reads as StaleHandle, because freeing zeroes the chunk's seq
with a full barrier before its bytes are reused, and the worker checks the seq after its
copy. A full outbox (photos outstanding past its capacity) answers None: the job then carries
the bytes itself, as before.

The ring's name is random (another user can neither predict nor take it; the file is 0600).
Threads: put and done from any thread of the owner; read_photo from any thread of a worker.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from typing import Any

from ..errors import CorruptObject, InvalidArgument, StaleHandle
from ..shm._header import MAX_NAME_CHARS
from ..shm._ring import CHUNK_SEQ, RingWriter, ShmRingBuffer

__all__ = ["PhotoOutbox", "read_photo", "PHOTO_RING_BYTES", "check_photo_ref"]

PHOTO_RING_BYTES = 128 << 20  # photos outstanding at once per API server (a 12 MP JPEG: ~5 MB;
# a pool of 8 holds at most 24 jobs); reserved in /dev/shm when the outbox is made
MAX_ATTACHED = 16  # outboxes a worker keeps mapped (one per API server of the node)


def check_photo_ref(ref: Any) -> tuple[str, int, int, int]:
    """`ref` as (ring name, address, seq, size); InvalidArgument unless it has that shape."""
    if (not isinstance(ref, (list, tuple)) or len(ref) != 4 or not isinstance(ref[0], str)
            or not all(type(word) is int and word >= 0 for word in ref[1:])):
        raise InvalidArgument(f"a photo reference is [ring name, address, seq, size], not "
                              f"{ref!r:.80}", "photo", None)
    return ref[0], ref[1], ref[2], ref[3]


class PhotoOutbox:
    """One API server's photos for the node's miss pool, in a ring of its own. Owner: the
    process that made it (it unlinks the ring at close); put and done from any thread."""

    _ring: RingWriter | None = None

    def __init__(self, store_name: str, capacity_bytes: int = PHOTO_RING_BYTES) -> None:
        suffix = f".photos-{secrets.token_hex(6)}"
        name = store_name[:MAX_NAME_CHARS - len(suffix)] + suffix
        self._lock = threading.Lock()
        self._done: set[int] = set()
        self._ring = RingWriter.create(name, capacity_bytes=capacity_bytes, prefault=False)
        self.name = name

    def put(self, data: bytes | memoryview) -> list[Any] | None:
        """Copy `data` into the ring; its reference, or None when the ring has no room now
        (too many photos outstanding: send the bytes with the job instead)."""
        with self._lock:
            ring = self._ring
            if ring is None:
                return None
            chunk = ring.allocate_if_free(len(data))
            if chunk is None:
                return None
            ring.payload(chunk)[:] = data  # the one copy in
            return [ring.name, chunk.address, chunk.seq, len(data)]

    def done(self, ref: list[Any]) -> None:
        """The job that carried `ref` has come back: its chunk may be freed (once the older
        ones are; the ring frees oldest first)."""
        with self._lock:
            ring = self._ring
            if ring is None:
                return
            self._done.add(ref[2])
            while (oldest := ring.oldest()) is not None and oldest.seq in self._done:
                self._done.discard(oldest.seq)
                ring.tombstone(oldest)  # a late reader of it fails its seq check from here on
                ring.pop_oldest(oldest)

    @property
    def outstanding(self) -> int:
        """Photos put and not freed yet."""
        with self._lock:
            return 0 if self._ring is None else len(self._ring)

    def close(self) -> None:
        """Unlink the ring (a worker still reading keeps its mapping); idempotent."""
        with self._lock:
            ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()

    def __enter__(self) -> PhotoOutbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ATTACHED: OrderedDict[str, ShmRingBuffer] = OrderedDict()
_ATTACHED_LOCK = threading.Lock()


def _ring(name: str) -> ShmRingBuffer:
    with _ATTACHED_LOCK:
        ring = _ATTACHED.get(name)
        if ring is None:
            ring = _ATTACHED[name] = ShmRingBuffer.attach(name, prefault=False)
            while len(_ATTACHED) > MAX_ATTACHED:  # an API server gone: its mapping goes
                _ATTACHED.popitem(last=False)[1].close()
        _ATTACHED.move_to_end(name)
        return ring


def read_photo(ref: Any) -> bytes:
    """The photo `ref` names, copied out of its outbox's ring and checked: StaleHandle if its
    chunk was freed (before or during the copy), CorruptObject if the header or size is not
    what the reference says, SegmentNotFound if the outbox is gone."""
    name, address, seq, size = check_photo_ref(ref)
    ring = _ring(name)
    header = ring.header(address, seq)
    if header.payload_bytes != size:
        raise CorruptObject(f"photo chunk {seq} of {name!r} holds {header.payload_bytes} bytes, "
                            f"its reference says {size}")
    data = bytes(ring.payload_view(header))  # the one copy out (the decoder wants bytes)
    # acquire: this load is not made before the copy's (ARM may reorder plain loads); the
    # writer zeroes the seq with a full barrier before a freed chunk's bytes are reused
    if ring.segment.words.load_acquire(address + CHUNK_SEQ) != seq:  # freed meanwhile
        raise StaleHandle(f"photo chunk {seq} of {name!r} was freed while it was read; the "
                          "API server processes it itself", None)
    return data

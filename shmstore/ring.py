"""ShmRingBuffer: a single-writer ring of variable-size chunks in one Segment.

The data area holds chunks back to back. Chunks are freed strictly oldest-first; a chunk never
straddles the end of the data area (when the tail cannot hold it, the tail is skipped and the
chunk goes to the start). The writer keeps the list of live chunks in its own memory; readers only
read chunk headers at addresses they were given.

An `address` is always the segment offset of a chunk's header (a multiple of ALIGN_BYTES).

Chunk layout (little-endian)::

    offset  size  field
    0       8     seq             u64, 1, 2, 3, ... per ring, never reused (0: no chunk)
    8       8     chunk_bytes     u64, header + payload rounded up to ALIGN_BYTES
    16      8     payload_bytes   u64, the size asked of allocate()
    24      8     check           u64, mixes seq, sizes and the segment epoch
    32      32    reserved        zero
    64      ...   payload         starts on a cache line

Scenarios (data area of 8 lines, A..D chunks, '.' free)::

    1. allocate A(2) B(3)          [A A B B B . . .]   head=5 tail=A
    2. allocate C(3): tail is 3    [A A B B B C C C]   head=8 (end)
    3. free A                      [. . B B B C C C]   tail=B
    4. allocate D(2): end is full, wrap to the start
                                   [D D B B B C C C]   head=2 tail=B
    5. allocate E(1): only [2,2) is free before B    -> StoreFull
    6. free B, C; allocate E(4)    [D D E E E E . .]   head=6 tail=D

Who may call what: the writer (from `create`) allocates, frees and clears; anyone reads with
`access`. A payload memoryview stays valid until close(), but its bytes belong to the chunk only
until the writer frees it.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ._closeable import Closeable
from .errors import CorruptObject, SegmentClosed, StaleHandle, StoreFull
from .segment import ALIGN_BYTES, KIND_RING, SEGMENT_HEADER, Segment, align_up

__all__ = ["ShmRingBuffer", "RingWriter", "ChunkHeader", "CHUNK_HEADER"]

CHUNK_HEADER = struct.Struct("<QQQQ32x")
assert CHUNK_HEADER.size == ALIGN_BYTES  # the layout above; the payload starts on a cache line
_SEQ = struct.Struct("<Q")
_CHECK_MULTIPLIER = 0x9E3779B97F4A7C15  # golden-ratio odd constant: spreads bits of the mix
_U64_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """A validated chunk header."""

    address: int
    seq: int
    chunk_bytes: int
    payload_bytes: int


def _check_word(seq: int, chunk_bytes: int, payload_bytes: int, epoch: int) -> int:
    mixed = (seq * _CHECK_MULTIPLIER) ^ (chunk_bytes << 20) ^ payload_bytes ^ epoch
    return mixed & _U64_MASK


class ShmRingBuffer(Closeable):
    """A ring buffer attached for reading: `access(address)`.

    Use `ShmRingBuffer.create` to make one (a RingWriter) and `ShmRingBuffer.attach` to read one
    from any process of the same user.
    """

    _seg: Segment | None = None
    _buf: memoryview | None = None  # the segment's mapping; None once closed

    def __init__(self, segment: Segment) -> None:
        self._seg = segment
        self._buf = segment.buf
        self._data_start = segment.data_offset
        self._data_end = segment.data_offset + segment.capacity_bytes
        self._epoch = segment.epoch

    @classmethod
    def create(
        cls,
        name: str | None,
        capacity: int,
        *,
        meta_bytes: int = 0,
        n_readers: int = 0,
        mode: int = 0o600,
        prefault: bool = True,
    ) -> RingWriter:
        """Create a ring with a data area of `capacity` bytes (rounded up to a cache line)."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2 * ALIGN_BYTES:
            raise ValueError(f"capacity must be an int >= {2 * ALIGN_BYTES} bytes, got {capacity!r}")
        segment = Segment.create(
            name, kind=KIND_RING, capacity_bytes=align_up(capacity), meta_bytes=meta_bytes,
            n_readers=n_readers, mode=mode, prefault=prefault,
        )
        return RingWriter(segment)

    @classmethod
    def attach(cls, name: str, *, prefault: bool = True) -> ShmRingBuffer:
        """Attach to an existing ring by name for reading."""
        return cls(Segment.attach(name, kind=KIND_RING, prefault=prefault))

    # -- properties --------------------------------------------------------------------------

    @property
    def segment(self) -> Segment:
        if self._seg is None:
            raise _closed_error()
        return self._seg

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def capacity(self) -> int:
        """Bytes in the data area."""
        return self.segment.capacity_bytes

    @property
    def meta(self) -> memoryview:
        """The area between the segment header and the data, for the layer above."""
        seg = self.segment
        return seg.buf[SEGMENT_HEADER.size:seg.data_offset]

    @property
    def closed(self) -> bool:
        return self._seg is None or self._seg.closed

    # -- reading -----------------------------------------------------------------------------

    def header(self, address: int, seq: int | None = None) -> ChunkHeader:
        """Read and validate the chunk header at `address`.

        Raises:
            StaleHandle: `seq` is given and the chunk there has another seq (freed or reused).
            CorruptObject: the bytes there are not a valid chunk header.
        """
        buf = self._buf
        if buf is None:
            raise _closed_error()
        if (isinstance(address, bool) or not isinstance(address, int)
                or address < self._data_start or address + ALIGN_BYTES > self._data_end
                or (address - self._data_start) % ALIGN_BYTES):
            raise CorruptObject(
                f"address {address!r} is not a chunk address in ring {self.name!r} (a multiple of "
                f"{ALIGN_BYTES} in [{self._data_start}, {self._data_end})): the handle is damaged"
            )
        chunk_seq, chunk_bytes, payload_bytes, check = CHUNK_HEADER.unpack_from(buf, address)
        if seq is not None and chunk_seq != seq:
            raise StaleHandle(
                f"chunk at address {address} of ring {self.name!r} now has seq {chunk_seq}, not "
                f"{seq}: the object was freed or overwritten; ask the writer to send it again"
            )
        if (chunk_seq == 0 or check != _check_word(chunk_seq, chunk_bytes, payload_bytes, self._epoch)
                or chunk_bytes != ALIGN_BYTES + align_up(payload_bytes)
                or address + chunk_bytes > self._data_end):
            raise CorruptObject(
                f"no valid chunk at address {address} of ring {self.name!r} (seq {chunk_seq}, "
                f"{chunk_bytes} chunk bytes, {payload_bytes} payload bytes): the segment is "
                "corrupt or the handle is damaged"
            )
        return ChunkHeader(address, chunk_seq, chunk_bytes, payload_bytes)

    def current_seq(self, address: int) -> int:
        """Return the seq now stored at `address` (unvalidated; for re-checks after a read)."""
        buf = self._buf
        if buf is None:
            raise _closed_error()
        return int(_SEQ.unpack_from(buf, address)[0])

    @contextmanager
    def access(self, address: int, seq: int | None = None) -> Iterator[tuple[memoryview, ChunkHeader]]:
        """Yield the payload memoryview of the chunk at `address` and its header.

        On exit the seq is read again: if the writer reused the chunk meanwhile, what was read may
        be torn and StaleHandle is raised.
        """
        header = self.header(address, seq)
        start = address + ALIGN_BYTES
        yield self.segment.buf[start:start + header.payload_bytes], header
        if self.current_seq(address) != header.seq:
            raise StaleHandle(
                f"chunk seq {header.seq} at address {address} of ring {self.name!r} was "
                "overwritten while it was being read; what was read is not valid"
            )

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Detach this process; idempotent."""
        self._buf = None
        if self._seg is not None:
            self._seg.close()


    def __repr__(self) -> str:
        if self.closed:
            return f"<{type(self).__name__} closed>"
        return f"<{type(self).__name__} {self.name!r} capacity={self.capacity}>"


class RingWriter(ShmRingBuffer):
    """The single writer of a ring: allocate, free (oldest first) and clear.

    Only the process that created the ring holds one. It owns the name and unlinks it on close.
    """

    def __init__(self, segment: Segment) -> None:
        super().__init__(segment)
        # (address, seq, chunk_bytes, payload_bytes), oldest first
        self._chunks: deque[tuple[int, int, int, int]] = deque()
        self._head = self._data_start
        self._next_seq = 1
        self._used_bytes = 0

    @property
    def used_bytes(self) -> int:
        """Bytes held by live chunks, headers included."""
        return self._used_bytes

    def __len__(self) -> int:
        return len(self._chunks)

    def oldest(self) -> tuple[int, int] | None:
        """(address, seq) of the oldest live chunk, or None when empty."""
        if not self._chunks:
            return None
        address, seq, _, _ = self._chunks[0]
        return address, seq

    def chunk_bytes_for(self, nbytes: int) -> int:
        """Ring bytes a payload of `nbytes` takes, header included."""
        return ALIGN_BYTES + align_up(nbytes)

    def _place(self, chunk_bytes: int) -> int | None:
        start, end = self._data_start, self._data_end
        if not self._chunks:
            return start if chunk_bytes <= end - start else None
        oldest = self._chunks[0][0]
        head = self._head
        if head > oldest:  # live chunks run oldest..head: free space is [head, end) + [start, oldest)
            if head + chunk_bytes <= end:
                return head
            return start if start + chunk_bytes <= oldest else None
        return head if head + chunk_bytes <= oldest else None  # wrapped: free is [head, oldest)

    def fits(self, nbytes: int) -> bool:
        """Say whether allocate(nbytes) would succeed now."""
        return self._place(self.chunk_bytes_for(nbytes)) is not None

    def allocate(self, nbytes: int) -> tuple[int, int]:
        """Reserve a chunk for `nbytes` of payload; return its (address, seq).

        Raises:
            StoreFull: no contiguous space is left (free old chunks first).
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        chunk_bytes = self.chunk_bytes_for(nbytes)
        address = self._place(chunk_bytes)
        if address is None:
            raise StoreFull(
                f"ring {self.name!r} has no contiguous {chunk_bytes} bytes free "
                f"({self._used_bytes} of {self.capacity} bytes in use by {len(self._chunks)} "
                "chunks): free old chunks, or create a larger ring",
                chunk_bytes, self.capacity,
            )
        seq = self._next_seq
        self._next_seq = seq + 1
        CHUNK_HEADER.pack_into(
            self.segment.buf, address, seq, chunk_bytes, nbytes,
            _check_word(seq, chunk_bytes, nbytes, self._epoch),
        )
        self._chunks.append((address, seq, chunk_bytes, nbytes))
        self._head = address + chunk_bytes
        self._used_bytes += chunk_bytes
        return address, seq

    def payload(self, address: int) -> memoryview:
        """The writable payload of a chunk this writer allocated."""
        header = self.header(address)
        start = address + ALIGN_BYTES
        return self.segment.buf[start:start + header.payload_bytes]

    def free(self, is_free: Callable[[int, memoryview], bool], nbytes: int | None = None) -> list[int]:
        """Free chunks oldest-first while `is_free(seq, payload)` says yes; return their seqs.

        Stops at the first chunk that may not go, and once `nbytes` (chunk bytes, headers
        included) have been freed when given.
        """
        freed: list[int] = []
        freed_bytes = 0
        buf = self.segment.buf
        while self._chunks and (nbytes is None or freed_bytes < nbytes):
            address, seq, chunk_bytes, payload_bytes = self._chunks[0]
            start = address + ALIGN_BYTES
            if not is_free(seq, buf[start:start + payload_bytes]):
                break
            _SEQ.pack_into(buf, address, 0)  # stale handles now fail at once
            self._chunks.popleft()
            self._used_bytes -= chunk_bytes
            freed_bytes += chunk_bytes
            freed.append(seq)
        return freed

    def clear(self) -> list[int]:
        """Free every chunk whatever its state; seqs keep increasing. Return the freed seqs."""
        buf = self.segment.buf
        seqs = []
        for address, seq, _, _ in self._chunks:
            _SEQ.pack_into(buf, address, 0)
            seqs.append(seq)
        self._chunks.clear()
        self._head = self._data_start
        self._used_bytes = 0
        return seqs

    def close(self) -> None:
        """Detach and remove the name from /dev/shm; idempotent."""
        self._buf = None
        if self._seg is not None:
            self._seg.close()
            self._seg.unlink()


def _closed_error() -> SegmentClosed:
    return SegmentClosed("the ring buffer is closed; attach it again to use it")

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

The writer keeps every live chunk's header in its own memory (`Chunk`) and never reads a
header back from shared memory: a damaged header can mislead readers (who then fail loudly),
never the writer.

Freeing is two steps: `tombstone` zeroes the chunk's seq word (a full-barrier exchange, so new
reads of its handles fail), then `pop_oldest` gives the bytes back once the layer above has made
sure no reader is still inside the chunk (store/_object_store.py: reader pins).

Who may call what: the writer (from `create`) allocates, tombstones and pops; anyone reads
headers with `header` and payloads with `payload_view`. A payload memoryview stays valid until
close(), but its bytes belong to the chunk only until the writer pops it.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass
from typing import Any

from .._proc import int_arg
from ..errors import CorruptObject, SegmentClosed, StaleHandle, StoreFull
from ._closeable import Closeable
from ._segment import ALIGN_BYTES, KIND_RING, MAX_CAPACITY_BYTES, SEGMENT_HEADER, Segment, align_up

__all__ = ["ShmRingBuffer", "RingWriter", "ChunkHeader", "Chunk", "CHUNK_HEADER", "CHUNK_SEQ",
           "place_chunk"]

CHUNK_HEADER = struct.Struct("<QQQQ32x")
assert CHUNK_HEADER.size == ALIGN_BYTES  # the layout above; the payload starts on a cache line
CHUNK_SEQ = 0  # byte offset of seq in a chunk header
_SEQ = struct.Struct("<Q")
_CHECK_MULTIPLIER = 0x9E3779B97F4A7C15  # golden-ratio odd constant: spreads bits of the mix
_U64_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """A chunk header as a reader validated it."""

    address: int
    seq: int
    chunk_bytes: int
    payload_bytes: int


@dataclass(slots=True, eq=False)
class Chunk:
    """The writer's private record of one live chunk; `owner` is the layer's record of it."""

    address: int
    seq: int
    chunk_bytes: int
    payload_bytes: int
    owner: Any = None
    tombstoned: bool = False
    through: int = 0  # chunk bytes allocated up to and including this one since the ring emptied


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
        *,
        capacity_bytes: int,
        meta_bytes: int = 0,
        n_readers: int = 0,
        mode: int = 0o600,
        prefault: bool = True,
    ) -> RingWriter:
        """Create a ring with a data area of `capacity_bytes` (rounded up to a cache line)."""
        capacity_bytes = int_arg(capacity_bytes, "capacity_bytes", 2 * ALIGN_BYTES,
                                 MAX_CAPACITY_BYTES)
        segment = Segment.create(
            name, kind=KIND_RING, capacity_bytes=align_up(capacity_bytes), meta_bytes=meta_bytes,
            n_readers=n_readers, mode=mode, prefault=prefault,
        )
        return RingWriter(segment)

    @staticmethod
    def segment_bytes(capacity_bytes: int, meta_bytes: int) -> int:
        """Bytes of /dev/shm create() reserves for these arguments."""
        return Segment.total_bytes_for(align_up(capacity_bytes), meta_bytes)

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
    def capacity_bytes(self) -> int:
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

    def valid_address(self, address: object) -> bool:
        """Whether `address` can be a chunk address of this ring (not whether one is there)."""
        return (type(address) is int and self._data_start <= address
                and address + ALIGN_BYTES <= self._data_end
                and (address - self._data_start) % ALIGN_BYTES == 0)

    def header(self, address: int, seq: int | None = None) -> ChunkHeader:
        """Read and validate the chunk header at `address`.

        Raises:
            StaleHandle: `seq` is given and the chunk there has another seq (freed or reused).
            CorruptObject: the bytes there are not a valid chunk header.
        """
        buf = self._buf
        if buf is None:
            raise _closed_error()
        if not self.valid_address(address):
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

    def payload_view(self, header: ChunkHeader) -> memoryview:
        """The payload of a chunk whose header was validated by `header()`."""
        if self._buf is None:
            raise _closed_error()
        start = header.address + ALIGN_BYTES
        return self._buf[start:start + header.payload_bytes]

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Detach this process; idempotent."""
        self._buf = None
        if self._seg is not None:
            self._seg.close()


    def __repr__(self) -> str:
        if self.closed:
            return f"<{type(self).__name__} closed>"
        return f"<{type(self).__name__} {self.name!r} capacity_bytes={self.capacity_bytes}>"


class RingWriter(ShmRingBuffer):
    """The single writer of a ring: allocate, tombstone and pop (oldest first).

    Only the process that created the ring holds one. It owns the name and unlinks it on close.
    """

    def __init__(self, segment: Segment) -> None:
        super().__init__(segment)
        # The deque is the only state besides the seq counter: the head and the bytes in use are
        # derived from it, so no exception between two statements can make them disagree.
        self._chunks: deque[Chunk] = deque()  # oldest first
        self._next_seq = 1
        self._words = segment.words

    @property
    def used_bytes(self) -> int:
        """Bytes held by live chunks, headers included: O(1), from the oldest and the newest
        chunk's running totals (chunks leave oldest first, so those between add up)."""
        chunks = self._chunks
        for _ in range(99):  # another thread's put or pop may change the deque between reads
            try:
                oldest, newest = chunks[0], chunks[-1]
            except IndexError:
                if not chunks:
                    return 0
                continue
            used = newest.through - oldest.through + oldest.chunk_bytes
            if used >= 0:
                return used
        return sum(chunk.chunk_bytes for chunk in self)

    def __len__(self) -> int:
        return len(self._chunks)

    def __iter__(self) -> Any:
        for _ in range(99):  # a snapshot; another thread's put may change the deque mid-copy
            try:
                return iter(tuple(self._chunks))
            except RuntimeError:
                continue
        return iter(tuple(self._chunks))

    def oldest(self) -> Chunk | None:
        """The oldest live chunk, or None when empty."""
        return self._chunks[0] if self._chunks else None

    @staticmethod
    def chunk_bytes_for(nbytes: int) -> int:
        """Ring bytes a payload of `nbytes` takes, header included."""
        return ALIGN_BYTES + align_up(nbytes)

    def _place(self, chunk_bytes: int) -> int | None:
        chunks = self._chunks
        if not chunks:
            return place_chunk(self._data_start, self._data_end, None, 0, chunk_bytes)
        newest = chunks[-1]
        return place_chunk(self._data_start, self._data_end, chunks[0].address,
                           newest.address + newest.chunk_bytes, chunk_bytes)

    def fits(self, nbytes: int) -> bool:
        """Say whether allocate(nbytes) would succeed now."""
        return self._place(self.chunk_bytes_for(nbytes)) is not None

    def allocate(self, nbytes: int) -> Chunk:
        """Reserve a chunk for `nbytes` of payload at the head and return it (owner None).

        Raises:
            StoreFull: no contiguous space is left (free old chunks first).
        """
        chunk = self.allocate_if_free(nbytes)
        if chunk is None:
            chunk_bytes = self.chunk_bytes_for(nbytes)
            raise StoreFull(
                f"ring {self.name!r} has no contiguous {chunk_bytes} bytes free "
                f"({self.used_bytes} of {self.capacity_bytes} bytes in use by "
                f"{len(self._chunks)} chunks): free old chunks, or create a larger ring",
                chunk_bytes, self.capacity_bytes,
            )
        return chunk

    def allocate_if_free(self, nbytes: int) -> Chunk | None:
        """allocate(), or None where no contiguous space is left (fits() and allocate() in one
        placement: the store's put asks this once per object)."""
        if type(nbytes) is not int or not 0 <= nbytes <= self._data_end - self._data_start:
            nbytes = int_arg(nbytes, "nbytes", 0, self._data_end - self._data_start)  # or raise
        chunk_bytes = self.chunk_bytes_for(nbytes)
        address = self._place(chunk_bytes)
        if address is None:
            return None
        seq = self._next_seq
        CHUNK_HEADER.pack_into(
            self.segment.buf, address, seq, chunk_bytes, nbytes,
            _check_word(seq, chunk_bytes, nbytes, self._epoch),
        )
        chunks = self._chunks
        chunk = Chunk(address, seq, chunk_bytes, nbytes,
                      through=(chunks[-1].through if chunks else 0) + chunk_bytes)
        self._next_seq = seq + 1
        chunks.append(chunk)  # the commit: one statement
        return chunk

    def payload(self, chunk: Chunk) -> memoryview:
        """The writable payload of a live chunk (sizes from the writer's own record)."""
        start = chunk.address + ALIGN_BYTES
        return self.segment.buf[start:start + chunk.payload_bytes]

    def header_intact(self, chunk: Chunk) -> bool:
        """Whether the chunk's header in shared memory still says what the writer wrote."""
        found = CHUNK_HEADER.unpack_from(self.segment.buf, chunk.address)
        expected = 0 if chunk.tombstoned else chunk.seq
        return found == (expected, chunk.chunk_bytes, chunk.payload_bytes,
                         _check_word(chunk.seq, chunk.chunk_bytes, chunk.payload_bytes,
                                     self._epoch))

    def tombstone(self, chunk: Chunk) -> None:
        """Zero the chunk's seq word with a full barrier: its handles are stale from now on."""
        chunk.tombstoned = True
        self._words.exchange(chunk.address + CHUNK_SEQ, 0)

    def pop_oldest(self, chunk: Chunk) -> None:
        """Give the oldest chunk's bytes back; it must be `chunk` and tombstoned."""
        if not self._chunks or self._chunks[0] is not chunk or not chunk.tombstoned:
            raise ValueError("pop_oldest: the chunk must be the oldest and tombstoned first")
        self._chunks.popleft()

    def close(self) -> None:
        """Detach and remove the name from /dev/shm; idempotent."""
        self._buf = None
        if self._seg is not None:
            self._seg.close()
            self._seg.unlink()


def place_chunk(start: int, end: int, oldest: int | None, head: int,
                chunk_bytes: int) -> int | None:
    """Where a chunk of `chunk_bytes` goes in the data area [start, end) whose live chunks run
    from the address `oldest` (None: no chunk) to `head`, or None if it does not fit yet. The
    one placement rule, shared with the metadata replay (cache/_hitsim.py)."""
    if oldest is None:
        return start if chunk_bytes <= end - start else None
    if head > oldest:  # live chunks run oldest..head: free space is [head, end) + [start, oldest)
        if head + chunk_bytes <= end:
            return head
        return start if start + chunk_bytes <= oldest else None
    return head if head + chunk_bytes <= oldest else None  # wrapped: free is [head, oldest)


def _closed_error() -> SegmentClosed:
    return SegmentClosed("the ring buffer is closed; attach it again to use it")

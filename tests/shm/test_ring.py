"""ShmRingBuffer: allocation, FIFO freeing, wraparound, clear, and a model-checked state machine."""

from __future__ import annotations

import struct

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmstore.shm._ring import CHUNK_HEADER
from shmstore.shm._segment import ALIGN_BYTES
from tests._names import (
    CorruptObject,
    InvalidArgument,
    RingWriter,
    SegmentClosed,
    ShmRingBuffer,
    StaleHandle,
    StoreFull,
)
from tests.conftest import new_name

LINE = ALIGN_BYTES


def test_chunk_header_offsets() -> None:
    raw = CHUNK_HEADER.pack(1, 2, 3, 4)
    assert struct.unpack_from("<QQQQ", raw, 0) == (1, 2, 3, 4)
    assert CHUNK_HEADER.size == LINE and raw[32:] == bytes(32)


@pytest.fixture
def ring(name: str):
    w = ShmRingBuffer.create(name, capacity_bytes=8 * LINE)
    yield w
    w.close()


def pop(ring: RingWriter, n: int = 1) -> list[int]:
    """Tombstone and give back the `n` oldest chunks; return their seqs."""
    seqs = []
    for _ in range(n):
        chunk = ring.oldest()
        assert chunk is not None
        ring.tombstone(chunk)
        ring.pop_oldest(chunk)
        seqs.append(chunk.seq)
    return seqs


def test_allocate_until_full_raises(ring: RingWriter) -> None:
    addresses = [ring.allocate(0).address for _ in range(8)]  # 8 header-only chunks: 8 lines
    assert addresses == [ring.segment.data_offset + i * LINE for i in range(8)]
    with pytest.raises(StoreFull, match="no contiguous 64 bytes free"):
        ring.allocate(0)


def test_pop_goes_oldest_first_and_only_after_a_tombstone(ring: RingWriter) -> None:
    chunks = [ring.allocate(LINE) for _ in range(4)]
    with pytest.raises(ValueError, match="tombstoned first"):
        ring.pop_oldest(chunks[0])
    ring.tombstone(chunks[1])
    with pytest.raises(ValueError, match="must be the oldest"):
        ring.pop_oldest(chunks[1])
    assert pop(ring, 2) == [chunks[0].seq, chunks[1].seq]
    assert ring.oldest() is chunks[2] and len(ring) == 2
    assert pop(ring, 2) == [chunks[2].seq, chunks[3].seq] and len(ring) == 0


def test_full_buffer_allocation_after_everything_is_freed(ring: RingWriter) -> None:
    for _ in range(3):
        ring.allocate(LINE)
    with pytest.raises(StoreFull):
        ring.allocate(7 * LINE)
    pop(ring, 3)
    assert ring.allocate(7 * LINE).address == ring.segment.data_offset  # the whole ring


def test_wraparound_skips_the_tail_and_never_straddles(ring: RingWriter) -> None:
    a = ring.allocate(LINE)           # 2 lines
    ring.allocate(2 * LINE)           # 3 lines
    ring.allocate(2 * LINE)           # 3 lines: ring full
    pop(ring)                         # frees A: 2 lines at the start
    assert ring.allocate(LINE).address == a.address  # must wrap to the start
    with pytest.raises(StoreFull):
        ring.allocate(0)


def test_payload_views_and_sizes(ring: RingWriter) -> None:
    chunk = ring.allocate(10)
    ring.payload(chunk)[:] = b"0123456789"
    reader = ShmRingBuffer.attach(ring.name)
    try:
        header = reader.header(chunk.address, chunk.seq)
        assert bytes(reader.payload_view(header)) == b"0123456789"
        assert (header.seq, header.payload_bytes, header.chunk_bytes) == (chunk.seq, 10, 2 * LINE)
    finally:
        reader.close()


def test_tombstone_makes_the_chunk_stale_at_once(ring: RingWriter) -> None:
    chunk = ring.allocate(LINE)
    assert ring.header_intact(chunk)
    ring.tombstone(chunk)
    assert ring.header_intact(chunk)  # a tombstone is what the writer expects there now
    with pytest.raises(StaleHandle, match="freed or overwritten"):
        ring.header(chunk.address, chunk.seq)
    pop(ring)
    again = ring.allocate(LINE)  # same address, new seq
    assert again.address == chunk.address and again.seq > chunk.seq
    with pytest.raises(StaleHandle):
        ring.header(chunk.address, chunk.seq)


def test_header_intact_notices_any_damaged_byte(ring: RingWriter) -> None:
    chunk = ring.allocate(LINE)
    buf = ring.segment.buf
    for offset in range(32):
        saved = buf[chunk.address + offset]
        buf[chunk.address + offset] = saved ^ 0x40
        assert not ring.header_intact(chunk), offset
        buf[chunk.address + offset] = saved
    assert ring.header_intact(chunk)


@pytest.mark.parametrize("address", [-64, 0, 65, 10**9, True, "64"])
def test_bad_addresses_are_corrupt(ring: RingWriter, address: object) -> None:
    with pytest.raises(CorruptObject):
        ring.header(address)  # type: ignore[arg-type]


def test_garbage_header_is_corrupt(ring: RingWriter) -> None:
    chunk = ring.allocate(LINE)
    address, seq = chunk.address, chunk.seq
    ring.segment.buf[address + 8:address + 16] = (999).to_bytes(8, "little")  # chunk_bytes
    with pytest.raises(CorruptObject, match="no valid chunk"):
        ring.header(address, seq)


def test_seqs_keep_increasing_across_an_emptied_ring(ring: RingWriter) -> None:
    first = [ring.allocate(0) for _ in range(2)]
    pop(ring, 2)
    assert ring.allocate(0).seq > first[1].seq


def test_closed_ring_stays_closed(name: str) -> None:
    ring = ShmRingBuffer.create(name, capacity_bytes=4 * LINE)
    ring.close()
    ring.close()
    with pytest.raises(SegmentClosed):
        ring.allocate(0)


@pytest.mark.parametrize("capacity", [0, 64, -1, 1.5, True])
def test_bad_capacity(capacity: object) -> None:
    with pytest.raises(InvalidArgument, match="capacity_bytes"):
        ShmRingBuffer.create(new_name("cap"), capacity_bytes=capacity)  # type: ignore[arg-type]


@pytest.mark.parametrize("nbytes", [-1, True, 1.5, "64", 8 * LINE + 1])
def test_allocate_checks_its_size_before_it_places_anything(ring, nbytes: object) -> None:
    with pytest.raises(InvalidArgument, match="nbytes"):
        ring.allocate(nbytes)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="nbytes"):
        ring.allocate_if_free(nbytes)  # type: ignore[arg-type]
    assert ring.oldest() is None


def test_allocate_takes_a_numpy_int_as_its_int(ring) -> None:
    import numpy as np

    chunk = ring.allocate_if_free(np.int64(LINE))
    assert chunk is not None and chunk.payload_bytes == LINE and type(chunk.payload_bytes) is int


class RingModel(RuleBasedStateMachine):
    """Drive the ring with random operations against a plain list of live chunks."""

    CAPACITY = 32 * LINE

    def __init__(self) -> None:
        super().__init__()
        self.ring = ShmRingBuffer.create(new_name("sm"), capacity_bytes=self.CAPACITY)
        self.start = self.ring.segment.data_offset
        self.end = self.start + self.CAPACITY
        self.live: list[tuple[int, int, int]] = []  # (address, seq, payload_bytes), oldest first
        self.last_seq = 0

    def teardown(self) -> None:
        self.ring.close()

    def expected_spot(self, chunk_bytes: int) -> int | None:
        """Where a FIFO ring must put the chunk: right after the newest, or wrapped to the start."""
        if not self.live:
            return self.start if chunk_bytes <= self.CAPACITY else None
        oldest = self.live[0][0]
        newest_address, _, newest_payload = self.live[-1]
        head = newest_address + LINE + -(-newest_payload // LINE) * LINE
        if head > oldest:
            if head + chunk_bytes <= self.end:
                return head
            return self.start if self.start + chunk_bytes <= oldest else None
        return head if head + chunk_bytes <= oldest else None

    @rule(nbytes=st.integers(min_value=0, max_value=12 * LINE))
    def allocate(self, nbytes: int) -> None:
        spot = self.expected_spot(LINE + -(-nbytes // LINE) * LINE)
        if spot is None:
            with pytest.raises(StoreFull):
                self.ring.allocate(nbytes)
            return
        chunk = self.ring.allocate(nbytes)
        address, seq = chunk.address, chunk.seq
        assert address == spot
        assert seq > self.last_seq
        self.last_seq = seq
        fill = (seq % 251).to_bytes(1, "little") * nbytes
        self.ring.payload(chunk)[:] = fill
        self.live.append((address, seq, nbytes))

    @precondition(lambda self: self.live)
    @rule(n=st.integers(min_value=1, max_value=6))
    def free(self, n: int) -> None:
        n = min(n, len(self.live))
        assert pop(self.ring, n) == [seq for _, seq, _ in self.live[:n]]
        self.live = self.live[n:]

    @invariant()
    def chunks_are_disjoint_in_bounds_and_intact(self) -> None:
        spans = sorted((a, a + LINE + -(-n // LINE) * LINE) for a, _, n in self.live)
        for (_, end_a), (start_b, _) in zip(spans, spans[1:]):
            assert end_a <= start_b
        for start, end in spans:
            assert self.start <= start and end <= self.end
        for address, seq, nbytes in self.live:
            header = self.ring.header(address, seq)
            assert header.payload_bytes == nbytes
            assert bytes(self.ring.payload_view(header)) == (seq % 251).to_bytes(1, "little") * nbytes
        assert self.ring.used_bytes == sum(e - s for s, e in spans)


RingModel.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_ring_state_machine = RingModel.TestCase
test_ring_state_machine.pytestmark = [pytest.mark.slow]

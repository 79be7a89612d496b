"""ShmRingBuffer: allocation, FIFO freeing, wraparound, clear, and a model-checked state machine."""

from __future__ import annotations

import struct

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmstore import CorruptObject, RingWriter, SegmentClosed, ShmRingBuffer, StaleHandle, StoreFull
from shmstore.ring import CHUNK_HEADER
from shmstore.segment import ALIGN_BYTES

from .conftest import new_name

LINE = ALIGN_BYTES


def test_chunk_header_offsets() -> None:
    raw = CHUNK_HEADER.pack(1, 2, 3, 4)
    assert struct.unpack_from("<QQQQ", raw, 0) == (1, 2, 3, 4)
    assert CHUNK_HEADER.size == LINE and raw[32:] == bytes(32)


@pytest.fixture
def ring(name: str):
    w = ShmRingBuffer.create(name, 8 * LINE)
    yield w
    w.close()


def test_allocate_until_full_raises(ring: RingWriter) -> None:
    addresses = [ring.allocate(0)[0] for _ in range(8)]  # 8 header-only chunks fill 8 lines
    assert addresses == [ring.segment.data_offset + i * LINE for i in range(8)]
    with pytest.raises(StoreFull, match="no contiguous 64 bytes free"):
        ring.allocate(0)


def test_free_returns_seqs_oldest_first_and_stops_at_first_busy(ring: RingWriter) -> None:
    seqs = [ring.allocate(LINE)[1] for _ in range(4)]
    busy = {seqs[2]}
    assert ring.free(lambda seq, payload: seq not in busy) == seqs[:2]
    assert ring.oldest() is not None and ring.oldest()[1] == seqs[2]  # type: ignore[index]
    busy.clear()
    assert ring.free(lambda seq, payload: True, nbytes=1) == [seqs[2]]  # stops once enough freed
    assert ring.free(lambda seq, payload: True) == [seqs[3]]
    assert len(ring) == 0


def test_full_buffer_allocation_after_everything_is_freed(ring: RingWriter) -> None:
    for _ in range(3):
        ring.allocate(LINE)
    with pytest.raises(StoreFull):
        ring.allocate(7 * LINE)
    ring.free(lambda seq, payload: True)
    address, _ = ring.allocate(7 * LINE)  # header + 7 lines = the whole ring
    assert address == ring.segment.data_offset


def test_wraparound_skips_the_tail_and_never_straddles(ring: RingWriter) -> None:
    a, _ = ring.allocate(LINE)        # 2 lines
    ring.allocate(2 * LINE)           # 3 lines
    ring.allocate(2 * LINE)           # 3 lines: ring full
    ring.free(lambda seq, payload: True, nbytes=1)  # frees A: 2 lines at the start
    d, _ = ring.allocate(LINE)        # must wrap to the start
    assert d == a
    with pytest.raises(StoreFull):
        ring.allocate(0)


def test_payload_views_and_sizes(ring: RingWriter) -> None:
    address, seq = ring.allocate(10)
    ring.payload(address)[:] = b"0123456789"
    reader = ShmRingBuffer.attach(ring.name)
    try:
        with reader.access(address, seq) as (payload, header):
            assert bytes(payload) == b"0123456789"
            assert (header.seq, header.payload_bytes, header.chunk_bytes) == (seq, 10, 2 * LINE)
    finally:
        reader.close()


def test_stale_address_and_overwrite_during_access(ring: RingWriter) -> None:
    address, seq = ring.allocate(LINE)
    ring.free(lambda s, p: True)
    with pytest.raises(StaleHandle, match="freed or overwritten"):
        ring.header(address, seq)
    address, seq = ring.allocate(LINE)
    with pytest.raises(StaleHandle, match="overwritten while it was being read"):
        with ring.access(address, seq):
            ring.clear()
            ring.allocate(LINE)  # same address, new seq


@pytest.mark.parametrize("address", [-64, 0, 65, 10**9, True, "64"])
def test_bad_addresses_are_corrupt(ring: RingWriter, address: object) -> None:
    with pytest.raises(CorruptObject):
        ring.header(address)  # type: ignore[arg-type]


def test_garbage_header_is_corrupt(ring: RingWriter) -> None:
    address, seq = ring.allocate(LINE)
    ring.segment.buf[address + 8:address + 16] = (999).to_bytes(8, "little")  # chunk_bytes
    with pytest.raises(CorruptObject, match="no valid chunk"):
        ring.header(address, seq)


def test_clear_keeps_seqs_increasing(ring: RingWriter) -> None:
    _, s1 = ring.allocate(0)
    address, s2 = ring.allocate(0)
    assert ring.clear() == [s1, s2]
    _, s3 = ring.allocate(0)
    assert s3 > s2
    with pytest.raises(StaleHandle):
        ring.header(address, s2)


def test_closed_ring_stays_closed(name: str) -> None:
    ring = ShmRingBuffer.create(name, 4 * LINE)
    ring.close()
    ring.close()
    with pytest.raises(SegmentClosed):
        ring.allocate(0)


@pytest.mark.parametrize("capacity", [0, 64, -1, 1.5, True])
def test_bad_capacity(capacity: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        ShmRingBuffer.create(new_name("cap"), capacity)  # type: ignore[arg-type]


class RingModel(RuleBasedStateMachine):
    """Drive the ring with random operations against a plain list of live chunks."""

    CAPACITY = 32 * LINE

    def __init__(self) -> None:
        super().__init__()
        self.ring = ShmRingBuffer.create(new_name("sm"), self.CAPACITY)
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
        address, seq = self.ring.allocate(nbytes)
        assert address == spot
        assert seq > self.last_seq
        self.last_seq = seq
        fill = (seq % 251).to_bytes(1, "little") * nbytes
        self.ring.payload(address)[:] = fill
        self.live.append((address, seq, nbytes))

    @precondition(lambda self: self.live)
    @rule(keep=st.integers(min_value=0, max_value=5), limit=st.none() | st.integers(1, 20 * LINE))
    def free(self, keep: int, limit: int | None) -> None:
        allowed = {seq for _, seq, _ in self.live[: max(0, len(self.live) - keep)]}
        seen = []

        def is_free(seq: int, payload: memoryview) -> bool:
            seen.append((seq, len(payload)))
            return seq in allowed

        freed = self.ring.free(is_free, nbytes=limit)
        expected, total = [], 0
        for _, seq, nbytes in self.live:
            if seq not in allowed or (limit is not None and total >= limit):
                break
            expected.append(seq)
            total += LINE + -(-nbytes // LINE) * LINE
        assert freed == expected
        assert [s for s, _ in seen[: len(freed)]] == freed
        sizes = {seq: nbytes for _, seq, nbytes in self.live}
        assert all(length == sizes[seq] for seq, length in seen)
        self.live = self.live[len(freed):]

    @rule()
    def clear(self) -> None:
        assert self.ring.clear() == [seq for _, seq, _ in self.live]
        self.live = []

    @invariant()
    def chunks_are_disjoint_in_bounds_and_intact(self) -> None:
        spans = sorted((a, a + LINE + -(-n // LINE) * LINE) for a, _, n in self.live)
        for (_, end_a), (start_b, _) in zip(spans, spans[1:]):
            assert end_a <= start_b
        for start, end in spans:
            assert self.start <= start and end <= self.end
        for address, seq, nbytes in self.live:
            with self.ring.access(address, seq) as (payload, header):
                assert header.payload_bytes == nbytes
                assert bytes(payload) == (seq % 251).to_bytes(1, "little") * nbytes
        assert self.ring.used_bytes == sum(e - s for s, e in spans)


RingModel.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_ring_state_machine = RingModel.TestCase

"""What the writer and the readers of one store share: the base class that maps the store and
checks handles, and the stats snapshot the writer takes."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import IncompatibleSegment, InvalidHandle, StaleHandle
from ..handle import Handle
from ..shm._closeable import CallGuard, Closeable
from ..shm._readers import ReaderTable
from ..shm._ring import ShmRingBuffer
from ..shm._segment import SEGMENT_HEADER
from ._layout import STORE_META, STORE_ROW, object_header_bytes
from ._policy import POLICY_IDS

__all__ = ["StoreBase", "StoreStats"]


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of one store, taken by the writer."""

    name: str
    policy: str
    policy_rule: str  # the rule applied now: the policy's name, or the rival adaptive follows
    capacity_bytes: int
    max_object_bytes: int
    n_readers: int
    bytes_in_use: int
    objects: int
    puts: int
    hits: int
    evictions: int
    give_backs: int
    full_events: int
    reinsertions: int  # objects copied forward instead of dropped (every policy but fifo)
    bytes_reinserted: int  # ring bytes those copies wrote
    damaged_objects: int  # objects dropped because their header in shared memory was damaged
    withdrawn: int  # objects dropped by withdraw() while readers still owed reads
    dead_readers: int  # readers found dead (their pid gone) and no longer waited for
    reader_lag: tuple[int, ...]  # hand-outs each reader owes on live objects
    reader_pids: tuple[int, ...]  # 0 where no reader is attached
    corrupt_reads: tuple[int, ...]  # objects each reader gave up on because they failed checks


class StoreBase(Closeable):
    """What the writer and the readers of one store share; use ObjectStore.create / attach."""

    _ring: ShmRingBuffer | None = None
    _guard: CallGuard | None = None
    name = ""
    n_readers = 0
    capacity_bytes = 0
    max_object_bytes = 0
    policy = ""
    epoch = 0

    def __init__(self, ring: ShmRingBuffer) -> None:
        self._ring = ring
        seg = ring.segment
        self.name = seg.name
        self.n_readers = seg.n_readers
        self.capacity_bytes = seg.capacity_bytes
        self.epoch = seg.epoch
        self._total_bytes = seg.total_bytes
        self._buf = seg.buf
        self._words = seg.words
        self._header_bytes = object_header_bytes(self.n_readers)
        self._meta = SEGMENT_HEADER.size
        meta = ring.meta
        if len(meta) < STORE_META.size + STORE_ROW.size * self.n_readers:
            raise IncompatibleSegment(
                f"store {self.name!r} has a {len(meta)}-byte meta area, too small for "
                f"{self.n_readers} readers: the segment is corrupt; recreate it", self.name)
        max_object_bytes, policy_id, _ = STORE_META.unpack_from(meta, 0)
        if policy_id not in POLICY_IDS or not 0 < max_object_bytes <= self.capacity_bytes:
            raise IncompatibleSegment(
                f"store {self.name!r} has policy id {policy_id} and max_object_bytes "
                f"{max_object_bytes}: the segment is corrupt or from another version", self.name)
        self.max_object_bytes = int(max_object_bytes)
        self.policy = POLICY_IDS[policy_id]
        self._table = ReaderTable(self._words, self._meta + STORE_META.size, self.n_readers,
                                  STORE_ROW.size, f"store {self.name!r}", self.name, self.epoch)

    @property
    def closed(self) -> bool:
        return self._guard is None or self._guard.closing

    @property
    def segment_bytes(self) -> int:
        """Shared memory the store reserved: its header, reader rows and ring."""
        return self._total_bytes

    def _check_handle(self, handle: Handle) -> None:
        if type(handle) is not Handle:
            raise InvalidHandle(f"expected a shmstore Handle, got {type(handle).__name__}")
        if handle.epoch != self.epoch:
            raise StaleHandle(self._epoch_mismatch(handle), handle, self.name)

    def _epoch_mismatch(self, handle: Handle) -> str:
        """What a handle of another epoch means, for the message."""
        return (f"handle {handle} belongs to another store or an earlier incarnation of "
                f"{self.name!r} (epoch {handle.epoch:#x}, this store {self.epoch:#x}); "
                "handles are valid only in the store that issued them")

    def close(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"capacity_bytes={self.capacity_bytes}"
        return f"<{type(self).__name__} {self.name!r} n_readers={self.n_readers} {state}>"

"""shmstore: preprocessed multimodal tensors in one shared-memory ring, read in place by N workers.

The core import stays light (numpy, msgpack, posix_ipc); torch is imported only when a tensor
is met.
"""

from .broadcast import BroadcastQueue, QueueReader, QueueWriter
from .cache import CACHE_KINDS, CacheStats, ReceiverCache, SenderCache, make_cache
from .channel import Channel, ChannelReader, ChannelWriter
from .errors import (
    BadMagic,
    Closed,
    CorruptObject,
    IncompatibleSegment,
    InvalidHandle,
    InvalidKey,
    InvalidName,
    KeyExists,
    KeyNotCached,
    MessageTooLarge,
    ObjectTooLarge,
    ReaderIndexError,
    ReaderSlotBusy,
    SegmentClosed,
    SegmentExists,
    SegmentNotFound,
    SegmentPermissionError,
    SegmentTooSmall,
    ShmSpaceError,
    ShmStoreError,
    StaleHandle,
    StoreFull,
    Timeout,
    VersionMismatch,
    WriterGone,
    WrongSegmentKind,
)
from .handle import Handle
from .hashing import mm_hash
from .ring import RingWriter, ShmRingBuffer
from .segment import Segment
from .serde import decode, dumps, encode, loads
from .store import ObjectStore, StoreReader, StoreStats, StoreWriter

__version__ = "0.1.0"

__all__ = [
    "CACHE_KINDS",
    "BadMagic",
    "BroadcastQueue",
    "CacheStats",
    "Channel",
    "ChannelReader",
    "ChannelWriter",
    "Closed",
    "CorruptObject",
    "Handle",
    "IncompatibleSegment",
    "InvalidHandle",
    "InvalidKey",
    "InvalidName",
    "KeyExists",
    "KeyNotCached",
    "MessageTooLarge",
    "ObjectStore",
    "ObjectTooLarge",
    "QueueReader",
    "QueueWriter",
    "ReaderIndexError",
    "ReceiverCache",
    "ReaderSlotBusy",
    "RingWriter",
    "Segment",
    "SegmentClosed",
    "SegmentExists",
    "SegmentNotFound",
    "SegmentPermissionError",
    "SegmentTooSmall",
    "SenderCache",
    "ShmRingBuffer",
    "ShmSpaceError",
    "ShmStoreError",
    "StaleHandle",
    "StoreFull",
    "StoreReader",
    "StoreStats",
    "StoreWriter",
    "Timeout",
    "VersionMismatch",
    "WriterGone",
    "WrongSegmentKind",
    "decode",
    "dumps",
    "encode",
    "loads",
    "make_cache",
    "mm_hash",
]

"""shmstore: preprocessed multimodal tensors in one shared-memory ring, read in place by N workers.

The core import stays light (numpy, msgpack, posix_ipc, blake3); torch is imported only when a
tensor is met. Layers below this surface (segment, ring, serde internals) stay importable from
their modules.
"""

from .broadcast import BroadcastQueue, QueueReader, QueueWriter
from .cache import CACHE_KINDS, CacheStats, ReceiverCache, SenderCache
from .channel import Channel, ChannelReader, ChannelWriter
from .errors import (
    Closed,
    CorruptObject,
    IncompatibleSegment,
    InvalidArgument,
    InvalidHandle,
    InvalidKey,
    KeyExists,
    KeyNotCached,
    MessageTooLarge,
    NotSerializable,
    ObjectTooLarge,
    ProtocolError,
    ReaderIndexError,
    ReaderSlotBusy,
    SegmentClosed,
    SegmentExists,
    SegmentNotFound,
    SegmentPermissionError,
    ShmSpaceError,
    ShmStoreError,
    StaleHandle,
    StoreFull,
    Timeout,
    WriterGone,
    WrongProcess,
    WrongThread,
)
from .handle import Handle
from .hashing import mm_hash
from .serde import Blank, dumps, loads
from .store import ObjectStore, StoreReader, StoreStats, StoreWriter

__version__ = "0.2.0"

__all__ = [
    # stores, queues, channels
    "ObjectStore",
    "StoreWriter",
    "StoreReader",
    "StoreStats",
    "Handle",
    "Blank",
    "BroadcastQueue",
    "QueueWriter",
    "QueueReader",
    "Channel",
    "ChannelWriter",
    "ChannelReader",
    # caches
    "CACHE_KINDS",
    "SenderCache",
    "ReceiverCache",
    "CacheStats",
    "mm_hash",
    # bytes
    "dumps",
    "loads",
    # errors (subclasses such as BadMagic live in shmstore.errors)
    "ShmStoreError",
    "InvalidArgument",
    "SegmentNotFound",
    "SegmentExists",
    "SegmentPermissionError",
    "IncompatibleSegment",
    "ShmSpaceError",
    "SegmentClosed",
    "WrongProcess",
    "WrongThread",
    "StoreFull",
    "ObjectTooLarge",
    "NotSerializable",
    "KeyExists",
    "KeyNotCached",
    "InvalidKey",
    "StaleHandle",
    "InvalidHandle",
    "CorruptObject",
    "ReaderIndexError",
    "ReaderSlotBusy",
    "Timeout",
    "Closed",
    "MessageTooLarge",
    "WriterGone",
    "ProtocolError",
]

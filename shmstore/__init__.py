"""shmstore: preprocessed multimodal tensors in one shared-memory ring, read in place by N workers.

The core import stays light (numpy, msgpack, posix_ipc, blake3); torch is imported only when a
tensor is met. The faces, each pinned by tests/test_public_api.py: `shmstore` (the everyday
classes and the errors a caller catches), `shmstore.errors` (every error), `shmstore.lowlevel`
(segments, the ring, policies, the writer host and remote writer), `shmstore.relay` and
`shmstore.vllm`. Every other module is an implementation detail.

Layers, lowest first; each may import only layers before it, and only those its docstring's
"May import:" line names (tests/test_layers.py checks both, and that no two modules
import each other):

    errors, handle, _proc   the words every layer shares: exceptions, Handle, process helpers
    _native                 the compiled boundary: the C module and which path runs
    shm                     segments, the ring, the reader table, waiting
    serde                   values to bytes and back, no pickle
    local                   a service on this machine for this user: names, server, connect, frames
    store                   the object store on one ring: put, get, view, hand-outs, policies
    queue                   the broadcast queue and the Channel
    cache                   sender and receiver caches, mm_hash, hit-ratio simulation
    relay                   a Channel published to other nodes over ZeroMQ
    serving                 an engine's hand-outs, whatever the engine: sender, requests, nodes
    metrics                 Prometheus metrics of a store and its relay Publisher
    vllm                    the vLLM plugin
    cli                     the `shmstore` command
"""

from .cache._caches import CACHE_KINDS, CacheStats, ReceiverCache, SenderCache
from .cache._hashing import mm_hash
from .errors import (
    Closed,
    CorruptObject,
    InvalidArgument,
    InvalidKey,
    KeyExists,
    KeyNotCached,
    MessageTooLarge,
    NotSerializable,
    ObjectTooLarge,
    SegmentExists,
    SegmentNotFound,
    ShmSpaceError,
    ShmStoreError,
    StaleHandle,
    StoreFull,
    Timeout,
    WriterGone,
)
from .handle import Handle, HandOut
from .queue._broadcast import BroadcastQueue, QueueReader, QueueWriter
from .queue._channel import Channel, ChannelReader, ChannelWriter
from .serde._codec import Blank, dumps, loads
from .store._object_store import ObjectStore, StoreReader, StoreStats, StoreWriter

__version__ = "0.4.0"

__all__ = [
    # stores, queues, channels
    "ObjectStore",
    "StoreWriter",
    "StoreReader",
    "StoreStats",
    "Handle",
    "HandOut",
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
    # the errors a caller catches (every error, these included, is in shmstore.errors)
    "ShmStoreError",
    "InvalidArgument",
    "InvalidKey",
    "NotSerializable",
    "ObjectTooLarge",
    "StoreFull",
    "KeyExists",
    "KeyNotCached",
    "StaleHandle",
    "CorruptObject",
    "Timeout",
    "Closed",
    "WriterGone",
    "MessageTooLarge",
    "SegmentExists",
    "SegmentNotFound",
    "ShmSpaceError",
]

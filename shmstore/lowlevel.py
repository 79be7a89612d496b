"""The low-level parts, for code that builds its own layer on shmstore: one POSIX segment,
the ring inside it, the values' encoding, the eviction policies, and the writer served to other
processes of its user (WriterHost, RemoteWriter, and WriterAPI, the interface both writers
meet). Importing it imports the socket code of the host; `import shmstore` does not. Like
`shmstore/__init__.py`, a face above the layers: it re-exports, and no layer imports it.
"""

from .serde._codec import Encoded, Verbatim, decode, encode
from .shm._ring import RingWriter, ShmRingBuffer
from .shm._segment import Segment
from .store._api import WriterAPI
from .store._host import WriterHost
from .store._policy import (
    DEFAULT_POLICY,
    POLICIES,
    RING_POLICY,
    AdaptivePolicy,
    EvictionPolicy,
    FifoPolicy,
    FreqPolicy,
    RecencyPolicy,
    ReinsertPolicy,
    RingReplay,
    make_policy,
)
from .store._remote import RemoteWriter
from .store._writer import Reservation

__all__ = [
    "Segment", "ShmRingBuffer", "RingWriter",
    "encode", "decode", "Encoded", "Verbatim",
    "WriterAPI", "WriterHost", "RemoteWriter", "Reservation",
    "EvictionPolicy", "FifoPolicy", "ReinsertPolicy", "FreqPolicy", "RecencyPolicy",
    "AdaptivePolicy", "RingReplay", "POLICIES", "DEFAULT_POLICY", "RING_POLICY", "make_policy",
]

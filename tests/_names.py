"""Every name the tests use, public or from a lower layer, in one import place."""

from shmstore import *  # noqa: F403
from shmstore import __all__ as _public
from shmstore.errors import *  # noqa: F403
from shmstore.errors import __all__ as _errors
from shmstore.serde._codec import decode, encode
from shmstore.shm._ring import RingWriter, ShmRingBuffer
from shmstore.shm._segment import Segment

__all__ = [*_public, *_errors, "RingWriter", "ShmRingBuffer", "Segment", "decode", "encode"]

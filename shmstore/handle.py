"""Handle: what travels from the writer to the readers instead of the object.

Wire form (`Handle.pack()`, 40 bytes, little-endian)::

    offset  size  field
    0       8     address     u64, segment offset of the chunk header
    8       8     seq         u64, the chunk's sequence number
    16      16    key_digest  blake2b-128 of the key
    32      8     epoch       u64, the store's random epoch

Inside shmstore messages (serde, queue, channel) a Handle travels natively as a msgpack
extension; `pack`/`unpack` are for carrying it over other transports.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import NamedTuple

from .errors import InvalidHandle, InvalidKey

__all__ = ["Handle", "HandOut", "HANDLE_WIRE", "OBJECT_ID_BYTES", "MAX_RECORD_BYTES",
           "KEY_DIGEST_BYTES", "HANDOUT_WORDS",
           "key_digest", "check_key"]

KEY_DIGEST_BYTES = 16  # blake2b-128: collisions need ~2**64 keys
OBJECT_ID_BYTES = KEY_DIGEST_BYTES + 8  # the key digest and the seq its bytes were first put at
MAX_RECORD_BYTES = 768  # a HandOut's record: 1,024 of them with their hand-outs fit one frame
HANDLE_WIRE = struct.Struct("<QQ16sQ")
_U64_LIMIT = 1 << 64
# a hand-out's one word form (HandOut.to_words): every transport carries these unsigned 64-bit
# ints, in this order (byte strings as little-endian words); a record travels beside them
HANDOUT_WORDS = ("address", "seq", "digest_low", "digest_high", "epoch", "number", "id_0",
                 "id_1", "id_2")
_WORDS = struct.Struct(f"<{len(HANDOUT_WORDS)}Q")
_HANDOUT_BYTES = struct.Struct(f"<QQ{KEY_DIGEST_BYTES}sQQ{OBJECT_ID_BYTES}s")  # the same bytes


@dataclass(frozen=True, slots=True)
class Handle:
    """Names one object in one store: plain data, no live views or locks.

    Valid until every reader has released the object and the writer reclaims it, or until the
    writer clears the store; after that any read with it raises StaleHandle.
    """

    address: int
    seq: int
    key_digest: bytes
    epoch: int

    def __post_init__(self) -> None:
        for field in ("address", "seq", "epoch"):
            value = getattr(self, field)
            if type(value) is not int or not 0 <= value < _U64_LIMIT:
                raise InvalidHandle(f"Handle.{field} must be an int in [0, 2**64), got {value!r}")
        if type(self.key_digest) is not bytes or len(self.key_digest) != KEY_DIGEST_BYTES:
            raise InvalidHandle(
                f"Handle.key_digest must be {KEY_DIGEST_BYTES} bytes, got {self.key_digest!r}"
            )

    def pack(self) -> bytes:
        """Return the 40-byte wire form."""
        return HANDLE_WIRE.pack(self.address, self.seq, self.key_digest, self.epoch)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Handle:
        """Parse the wire form; raise InvalidHandle if it is not exactly one handle."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidHandle(f"a packed Handle is bytes, got {type(data).__name__}")
        if len(data) != HANDLE_WIRE.size:
            raise InvalidHandle(f"a packed Handle is {HANDLE_WIRE.size} bytes, got {len(data)}")
        address, seq, key_digest, epoch = HANDLE_WIRE.unpack(data)
        return cls(address, seq, key_digest, epoch)

    def __repr__(self) -> str:
        return (f"Handle(address={self.address}, seq={self.seq}, "
                f"key_digest={self.key_digest.hex()}, epoch={self.epoch:#x})")


class HandOut(NamedTuple):
    """One hand-out of a stored object: what every writer call that hands out returns.

    A hand-out is one read owed by each reader the object is handed to, until they read it or
    the writer takes it back. Send `handle` to the readers; name `number` to give this hand-out
    back, narrow it to some readers or end it (give_back, narrow, end_handouts). An immutable
    value (a named tuple: made on every hit, so it costs what a tuple costs).

    handle      names the object (StoreReader.get / view take it)
    number      the store-wide number of this hand-out (1, 2, 3, ... across every object)
    object_id   the id of the stored bytes (OBJECT_ID_BYTES: the key digest and the seq the
                bytes were first put at): the key a relay node stores them under
    record      the bytes under the field asked for (hand_out_cached(keys, field=...)); None
                when none was asked for, the object has no such field, or it is over
                MAX_RECORD_BYTES
    """

    handle: Handle
    number: int
    object_id: bytes
    record: bytes | None = None

    def __repr__(self) -> str:
        record = "" if self.record is None else f", record={len(self.record)} bytes"
        return (f"HandOut({self.handle!r}, number={self.number}, "
                f"object_id={self.object_id.hex()}{record})")

    def to_words(self) -> tuple[int, ...]:
        """The hand-out as every transport carries it (HANDOUT_WORDS: nine unsigned 64-bit ints,
        the record left out); `from_words` reads them back.

        Raises:
            InvalidHandle: a number that is not an int in [0, 2**64), or an object id that is
                not OBJECT_ID_BYTES bytes (a HandOut the store did not make).
        """
        h, number, object_id = self.handle, self.number, self.object_id
        if type(number) is not int or not 0 <= number < _U64_LIMIT:
            raise InvalidHandle(f"HandOut.number must be an int in [0, 2**64), got {number!r}")
        if type(object_id) is not bytes or len(object_id) != OBJECT_ID_BYTES:
            raise InvalidHandle(f"HandOut.object_id must be {OBJECT_ID_BYTES} bytes, got "
                                f"{object_id!r:.60}")
        return _WORDS.unpack(_HANDOUT_BYTES.pack(h.address, h.seq, h.key_digest, h.epoch, number,
                                                 object_id))

    @classmethod
    def from_words(cls, words: object, record: bytes | None = None) -> HandOut:
        """The hand-out `to_words` gave (with `record`, which travels beside the words).

        Raises:
            InvalidHandle: not HANDOUT_WORDS' nine ints in [0, 2**64) in a list or tuple.
        """
        try:
            if not isinstance(words, (list, tuple)) or not all(type(w) is int for w in words):
                raise struct.error
            address, seq, digest, epoch, number, object_id = _HANDOUT_BYTES.unpack(
                _WORDS.pack(*words))
        except struct.error:  # not nine ints, or one outside [0, 2**64)
            raise InvalidHandle(f"a hand-out's words are {len(HANDOUT_WORDS)} unsigned 64-bit "
                                f"ints ({', '.join(HANDOUT_WORDS)}), got {words!r:.120}") from None
        return cls(Handle(address, seq, digest, epoch), number, object_id, record)

    @property
    def origin(self) -> int:
        """The seq the bytes were first put at (the object id's last 8 bytes, little-endian):
        StoreReader.get(origin=...) checks it."""
        return int.from_bytes(self.object_id[KEY_DIGEST_BYTES:], "little")


def check_key(key: object) -> str | bytes:
    """Return `key` if it is a non-empty str or bytes; raise InvalidKey saying what keys are."""
    if type(key) is str or type(key) is bytes:
        if key:
            return key
        raise InvalidKey("keys must not be empty: use a content hash such as shmstore.mm_hash(...)")
    raise InvalidKey(f"keys are str or bytes (e.g. an mm hash), got {type(key).__name__}; "
                     "hash other values with shmstore's mm_hash or hashlib first")


def key_digest(key: str | bytes) -> bytes:
    """Return the 16-byte digest a Handle carries for `key` (str and bytes keys never collide)."""
    check_key(key)
    if isinstance(key, str):
        data = b"s" + key.encode("utf-8", "surrogatepass")
    else:
        data = b"b" + key
    return hashlib.blake2b(data, digest_size=KEY_DIGEST_BYTES).digest()

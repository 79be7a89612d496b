"""What a RemoteWriter and its WriterHost say to each other (store/_host.py has the picture).

A frame is a u32 length and a msgpack array, at most MAX_FRAME_BYTES. One table, OPS, names
every operation, the arguments it carries and whether a client may post it (send it without
waiting for a reply); the client encodes with `request()` and the host checks and decodes with
`parse_request()`, so the two sides cannot drift apart.

    request   [op, args...]                     args as OPS[op] lists them
              ["post", op, args...]             a postable op, no reply
    reply     [0, result]                       the call returned
              [1, error class name, message]    the call raised one of ERRORS (else a
                                                ShmStoreError naming the class)

Argument kinds, as the host checks them (a frame that breaks its schema is not ours: the host
drops the connection, ProtocolError; a key it refuses is answered, InvalidKey):

    key       str or bytes, checked by check_key
    keys      a list of at most MAX_KEYS keys, all checked before anything runs
    handle    [address, seq, key digest, epoch], rebuilt as a Handle
    number    a non-negative int
    number?   a non-negative int or None
    numbers   a list of non-negative ints
    groups    a list of [handle, numbers]
    flag      a bool
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import (
    InvalidArgument,
    InvalidKey,
    KeyExists,
    KeyNotCached,
    ObjectTooLarge,
    ProtocolError,
    ReaderIndexError,
    ShmStoreError,
    StaleHandle,
    StoreFull,
)
from ..handle import Handle, check_key

__all__ = ["PROTOCOL", "MAX_FRAME_BYTES", "MAX_KEYS", "OPS", "POSTABLE", "ERRORS", "Op",
           "send_frame", "recv_frame", "request", "parse_request", "handle_to_wire",
           "handle_from_wire", "int_list"]

PROTOCOL = 1
MAX_FRAME_BYTES = 1 << 20  # requests carry keys and hand-out numbers, never object bytes
MAX_KEYS = 1024  # keys in one hand_out_cached or cached call
LENGTH = struct.Struct("<I")

KEY, KEYS, HANDLE, NUMBER, MAYBE_NUMBER, NUMBERS, GROUPS, FLAG = (
    "key", "keys", "handle", "number", "number?", "numbers", "groups", "flag")


@dataclass(frozen=True)
class Op:
    """One operation: the kinds of its arguments, and whether a client may post it."""

    args: tuple[str, ...] = ()
    postable: bool = False


OPS: dict[str, Op] = {
    "hello": Op(),  # -> [protocol, name, n_readers, max_object_bytes]
    "len": Op(),
    "is_cached": Op((KEY,)),
    "cached": Op((KEYS,)),
    "get_cached": Op((KEY,)),  # -> [handle, hand-out number, object id]
    "hand_out_cached": Op((KEYS,)),  # -> per key: [handle, number, object id] or None
    "handle_of": Op((KEY,)),
    "object_id": Op((KEY,)),
    "give_back": Op((HANDLE, MAYBE_NUMBER), postable=True),
    "hand_out": Op((HANDLE,)),  # -> hand-out number
    "narrow": Op((HANDLE, NUMBER, NUMBERS), postable=True),
    "end_handouts": Op((GROUPS,)),
    "unread": Op((HANDLE,)),
    "withdraw": Op((HANDLE,)),
    "clear": Op((FLAG,)),
    "begin": Op((KEY, NUMBER, NUMBER)),  # key, body bytes, structure crc -> [loan, offset]
    "commit": Op((NUMBER,)),  # loan -> [handle, number, object id]
    "abandon": Op((NUMBER,)),  # loan
}
POSTABLE = tuple(name for name, op in OPS.items() if op.postable)

# errors that cross the socket: rebuilt on the client's side with their message
ERRORS: dict[str, Callable[[str], BaseException]] = {
    "StaleHandle": lambda m: StaleHandle(m),
    "KeyNotCached": lambda m: KeyNotCached(m, ""),
    "KeyExists": lambda m: KeyExists(m, ""),
    "ObjectTooLarge": lambda m: ObjectTooLarge(m, 0, 0),
    "StoreFull": lambda m: StoreFull(m, 0, 0),
    "ReaderIndexError": lambda m: ReaderIndexError(m, None, 0),
    "InvalidKey": lambda m: InvalidKey(m),
}


def handle_to_wire(handle: Handle) -> list[Any]:
    return [handle.address, handle.seq, handle.key_digest, handle.epoch]


def handle_from_wire(words: Any) -> Handle:
    if not isinstance(words, list) or len(words) != 4:
        raise ProtocolError("a handle is 4 fields")
    address, seq, digest, epoch = words
    try:
        return Handle(address, seq, digest, epoch)
    except (ShmStoreError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad handle: {exc}") from None


def int_list(values: Any, what: str) -> list[int]:
    if not isinstance(values, list) or any(type(v) is not int or v < 0 for v in values):
        raise ProtocolError(f"{what}: a list of non-negative ints")
    return values


def _keys(value: Any) -> list[str | bytes]:
    if not isinstance(value, list) or len(value) > MAX_KEYS:
        raise ProtocolError(f"a list of at most {MAX_KEYS} keys")
    for key in value:  # all checked first: a bad key runs nothing
        check_key(key)
    return value


def _groups(value: Any) -> list[tuple[Handle, list[int]]]:
    if not isinstance(value, list) or any(not isinstance(g, list) or len(g) != 2 for g in value):
        raise ProtocolError("a list of [handle, numbers]")
    return [(handle_from_wire(h), int_list(n, "numbers")) for h, n in value]


def _flag(value: Any) -> bool:
    if type(value) is not bool:
        raise ProtocolError("a flag is true or false")
    return value


_FROM_WIRE: dict[str, Callable[[Any], Any]] = {
    KEY: check_key,
    KEYS: _keys,
    HANDLE: handle_from_wire,
    NUMBER: lambda v: int_list([v], "a number")[0],
    MAYBE_NUMBER: lambda v: None if v is None else int_list([v], "a number")[0],
    NUMBERS: lambda v: int_list(v, "numbers"),
    GROUPS: _groups,
    FLAG: _flag,
}
_TO_WIRE: dict[str, Callable[[Any], Any]] = {
    HANDLE: handle_to_wire,
    KEYS: list,
    NUMBERS: list,
    GROUPS: lambda groups: [[handle_to_wire(h), list(n)] for h, n in groups],
    FLAG: bool,
}


def request(op: str, *args: Any, post: bool = False) -> list[Any]:
    """The frame of a call of `op` with `args` as the caller passes them (Handles, iterables)."""
    kinds = OPS[op].args
    if len(args) != len(kinds) or (post and not OPS[op].postable):
        raise InvalidArgument(f"{op} takes {len(kinds)} arguments and is "
                              f"{'' if OPS[op].postable else 'not '}postable", "op", op)
    wire = [_TO_WIRE.get(kind, lambda v: v)(value) for kind, value in zip(kinds, args)]
    return ["post", op, *wire] if post else [op, *wire]


def parse_request(frame: Any) -> tuple[str, list[Any], bool]:
    """(op, its arguments decoded, whether it was posted) of one received request.

    Raises:
        ProtocolError: not a request of this protocol (the host drops the connection).
        InvalidKey: a key check_key refuses (the host answers it).
    """
    if not isinstance(frame, list) or not frame or not isinstance(frame[0], str):
        raise ProtocolError("a request is [op, args...]")
    posted = frame[0] == "post"
    if posted:
        frame = frame[1:]
        if not frame or frame[0] not in POSTABLE:
            raise ProtocolError(f"only {', '.join(POSTABLE)} may be posted")
    op = OPS.get(frame[0])
    if op is None:
        raise ProtocolError(f"unknown request {str(frame[0])[:40]!r}")
    if len(frame) - 1 != len(op.args):
        raise ProtocolError(f"{frame[0]} carries {len(op.args)} arguments, not {len(frame) - 1}")
    try:
        args = [_FROM_WIRE[kind](value) for kind, value in zip(op.args, frame[1:])]
    except ProtocolError as exc:
        raise ProtocolError(f"{frame[0]}: {exc}") from None
    return frame[0], args, posted


def send_frame(sock: socket.socket, obj: Any) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:  # refused before sending: the connection stays usable
        raise InvalidArgument(f"a {obj[0]!r} request of {len(body)} bytes is over the "
                              f"{MAX_FRAME_BYTES}-byte frame limit: use shorter keys (a content "
                              "hash) or fewer at once", "request", len(body))
    sock.sendall(LENGTH.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    parts = []
    while n:
        part = sock.recv(min(n, 1 << 16))
        if not part:
            return None
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def recv_frame(sock: socket.socket) -> Any:
    """The next frame, None when the peer closed; ProtocolError for a frame out of bounds."""
    head = _recv_exact(sock, LENGTH.size)
    if head is None:
        return None
    (size,) = LENGTH.unpack(head)
    if not 0 < size <= MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {size} bytes (1..{MAX_FRAME_BYTES} allowed)")
    body = _recv_exact(sock, size)
    if body is None:
        return None
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise ProtocolError(f"frame is not msgpack: {exc}") from None

"""What a Publisher and its relays say to each other over ZeroMQ (relay/_node.py).

The publisher binds one ROUTER socket; each relay connects one DEALER socket with a random
routing id per connection, so a restarted or reconnected relay is a new peer. A ZeroMQ message
is a msgpack header `[kind, fields...]`, plus for INLINE and OBJECT one more frame: the value's
serde body (serde/_codec.py), the bytes a Channel stores, decoded and checked by the relay like any
bytes from shared memory. No pickle; a message that does not parse is dropped (ProtocolError).

    kind       from       fields                                  frame 2
    HELLO      relay      version, node name, epoch, held ids,    -
                          since (ns; rises with each connection)
    ACK        relay      through msg_no, ids evicted since       -
    NEED       relay      msg_no                                  -
    PING       both       -                                       -
    BYE        relay      -                                       -
    WELCOME    publisher  version, epoch, inline_threshold,       -
                          max_object_bytes, first msg_no
    INLINE     publisher  msg_no                                  value body
    OBJECT     publisher  msg_no, object id                       object body
    REF        publisher  msg_no, object id                       -
    LOST       publisher  msg_no (NEED could not be served)       -
    END        publisher  - (the writer ended the channel)        -
    GONE       publisher  writer pid (the writer died)            -

An object id (24 bytes) is the key digest and origin seq of the writer's stored object
(StoredBody): it names the bytes, not the key, so a key put again with other bytes gets a new
id, and ids are compared only within one writer store epoch.
"""

from __future__ import annotations

from typing import Any

import msgpack

from ..errors import ProtocolError

__all__ = ["PROTOCOL_VERSION", "OBJECT_ID_BYTES", "HELLO", "ACK", "NEED", "PING", "BYE",
           "WELCOME", "INLINE", "OBJECT", "REF", "LOST", "END", "GONE", "pack", "parse"]

PROTOCOL_VERSION = 2
OBJECT_ID_BYTES = 24  # key digest (16) + origin seq (8)
MAX_IDS = 1 << 16  # ids in one HELLO or ACK (a node holds at most MAX_HELD_IDS)
MAX_HEADER_BYTES = 4 << 20  # a HELLO listing MAX_IDS ids is under 2 MiB; anything larger is not ours
_U63 = 1 << 63

HELLO, ACK, NEED, PING, BYE = 1, 2, 3, 4, 5
WELCOME, INLINE, OBJECT, REF, LOST, END, GONE = 10, 11, 12, 13, 14, 15, 16

_INT, _STR, _ID, _IDS = "int", "str", "id", "ids"
SCHEMAS: dict[int, tuple[tuple[str, ...], bool]] = {  # kind: (field types, has a body frame)
    HELLO: ((_INT, _STR, _INT, _IDS, _INT), False),
    ACK: ((_INT, _IDS), False),
    NEED: ((_INT,), False),
    PING: ((), False),
    BYE: ((), False),
    WELCOME: ((_INT, _INT, _INT, _INT, _INT), False),
    INLINE: ((_INT,), True),
    OBJECT: ((_INT, _ID), True),
    REF: ((_INT, _ID), False),
    LOST: ((_INT,), False),
    END: ((), False),
    GONE: ((_INT,), False),
}
NAMES = {HELLO: "HELLO", ACK: "ACK", NEED: "NEED", PING: "PING", BYE: "BYE", WELCOME: "WELCOME",
         INLINE: "INLINE", OBJECT: "OBJECT", REF: "REF", LOST: "LOST", END: "END", GONE: "GONE"}


def pack(kind: int, *fields: Any) -> bytes:
    """The header frame of one message."""
    return bytes(msgpack.packb([kind, *fields]))


def _check(kind: int, types: tuple[str, ...], fields: list[Any]) -> None:
    if len(fields) != len(types):
        raise ProtocolError(f"{NAMES[kind]} carries {len(fields)} fields, not {len(types)}")
    for i, (want, value) in enumerate(zip(types, fields)):
        ok = {
            _INT: lambda v: type(v) is int and 0 <= v < _U63,
            _STR: lambda v: type(v) is str and len(v) <= 256,
            _ID: lambda v: type(v) is bytes and len(v) == OBJECT_ID_BYTES,
            _IDS: lambda v: (type(v) is list and len(v) <= MAX_IDS and all(
                type(x) is bytes and len(x) == OBJECT_ID_BYTES for x in v)),
        }[want](value)
        if not ok:
            raise ProtocolError(f"{NAMES[kind]} field {i} is {type(value).__name__} "
                                f"{str(value)[:40]!r}, not a valid {want}")


def parse(frames: list[Any]) -> tuple[int, list[Any], Any]:
    """(kind, fields, body frame or None) of one received message, checked against its schema.

    Raises:
        ProtocolError: not a message of this protocol version (the caller drops it).
    """
    if not 1 <= len(frames) <= 2:
        raise ProtocolError(f"a message has 1 or 2 frames, this one {len(frames)}")
    header = frames[0]
    data = header.buffer if hasattr(header, "buffer") else header
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"a {len(data)}-byte header is larger than {MAX_HEADER_BYTES}")
    try:
        items = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except ValueError as exc:  # msgpack's errors (and bad UTF-8) are ValueErrors
        raise ProtocolError(f"a header does not decode as msgpack: {exc}") from None
    if type(items) is not list or not items or type(items[0]) is not int:
        raise ProtocolError(f"a header is {type(items).__name__}, not [kind, fields...]")
    kind = items[0]
    if kind not in SCHEMAS:
        raise ProtocolError(f"unknown message kind {kind}")
    types, has_body = SCHEMAS[kind]
    _check(kind, types, items[1:])
    if has_body != (len(frames) == 2):
        raise ProtocolError(f"{NAMES[kind]} comes {'with' if has_body else 'without'} a body "
                            f"frame, this one has {len(frames)} frames")
    return kind, items[1:], frames[1] if has_body else None

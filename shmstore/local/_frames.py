"""Frames on a local service's socket: a u32 length, then one msgpack body.

    offset  size
    0       4     body length, little-endian u32, 1..limit
    4       n     msgpack (bin type for bytes; map keys are strings)

A body over the limit is refused before anything is sent (the connection stays usable); a
frame received over it, or one that is not msgpack, is the peer's fault: ProtocolError.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

from ..errors import InvalidArgument, ProtocolError

__all__ = ["LENGTH", "send_frame", "recv_frame", "pack", "unpack"]

LENGTH = struct.Struct("<I")
RECV_CHUNK_BYTES = 1 << 16  # one recv at most


def pack(obj: Any) -> bytes:
    """obj as a frame body; TypeError/ValueError/OverflowError for what msgpack cannot carry."""
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(body: bytes) -> Any:
    """A frame body back (what pack makes: string map keys); ProtocolError otherwise."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise ProtocolError(f"frame is not msgpack: {exc}") from None


def send_frame(sock: socket.socket, obj: Any, *, limit: int, what: str = "request",
               advice: str = "send less at once") -> None:
    """Send `obj` as one frame; InvalidArgument (nothing sent) when its body is over `limit`
    bytes, saying `what` it was and `advice`."""
    body = pack(obj)
    if len(body) > limit:  # refused before sending: the connection stays usable
        raise InvalidArgument(f"a {what} of {len(body)} bytes is over the {limit}-byte frame "
                              f"limit: {advice}", what, len(body))
    sock.sendall(LENGTH.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    parts = []
    while n:
        part = sock.recv(min(n, RECV_CHUNK_BYTES))
        if not part:
            return None
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def recv_frame(sock: socket.socket, *, limit: int) -> Any:
    """The next frame, None when the peer closed; ProtocolError for a frame out of bounds."""
    head = _recv_exact(sock, LENGTH.size)
    if head is None:
        return None
    (size,) = LENGTH.unpack(head)
    if not 0 < size <= limit:
        raise ProtocolError(f"frame of {size} bytes (1..{limit} allowed)")
    body = _recv_exact(sock, size)
    if body is None:
        return None
    return unpack(body)

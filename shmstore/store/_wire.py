"""What a RemoteWriter and its WriterHost say to each other (store/_host.py has the picture).

A frame is a u32 length and a msgpack array, at most MAX_FRAME_BYTES. One table, OPS, names
every operation, the arguments it carries and whether a client may post it (send it without
waiting for a reply); the client encodes with `request()` and the host checks and decodes with
`parse_request()`, so the two sides cannot drift apart.

    request   [op, args...]                     args as OPS[op] lists them
              ["post", op, args...]             a postable op, no reply
    reply     [0, result]                       the call returned
              [1, error class, message, fields] the call raised one of ERRORS (else a
                                                ShmStoreError naming the class): rebuilt on
                                                the client's side with its attributes; the
                                                message is cut to MAX_ERROR_CHARS, a field
                                                over MAX_FIELD_BYTES goes as None

Argument kinds, as the host checks them. A frame of the wrong shape or types is not ours:
the host drops the connection (ProtocolError). A well-typed value the writer refuses is
answered like any error of the call, and the connection stays (InvalidKey for a key,
InvalidHandle for handle fields out of range, StaleHandle or ReaderIndexError from the
writer for numbers it does not have):

    key       str or bytes, checked by check_key
    keys      a list of at most MAX_KEYS keys, all checked before anything runs
    handle    a list of 4: [address, seq, key digest, epoch], rebuilt as a Handle
    handout   a list of 2: [HandOut.to_words(), record or None], rebuilt by HandOut.from_words
              (also how every reply carries one)
    number    an int in [-2**63, 2**64)
    number?   a number or None
    numbers   a list of numbers
    groups    a list of [handle, numbers]
    flag      a bool
    field?    None, or the name of a peeked field (a str of 1 to MAX_FIELD_CHARS)
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._proc import int_arg
from ..errors import (
    InvalidArgument,
    InvalidHandle,
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
from ..handle import HANDOUT_WORDS, MAX_RECORD_BYTES, Handle, HandOut, check_key
from ..local import _frames as frames

__all__ = ["PROTOCOL", "MAX_FRAME_BYTES", "MAX_KEYS", "MAX_PEEK_BYTES", "MAX_GROUPS", "OPS",
           "POSTABLE", "ERRORS", "check_field",
           "Op", "send_frame", "recv_frame", "request", "parse_request", "handle_to_wire",
           "handle_from_wire", "handout_to_wire", "handout_from_wire", "int_list", "error_reply",
           "rebuild_error"]

PROTOCOL = 6
MAX_FRAME_BYTES = 1 << 20  # requests carry keys and hand-out numbers, never object bytes
MAX_KEYS = 1024  # keys in one hand_out_cached or cached frame (RemoteWriter splits longer lists)
MAX_PEEK_BYTES = MAX_RECORD_BYTES  # a peeked record: MAX_KEYS of them with their hand-outs fit
MAX_FIELD_CHARS = 64  # the name of a peeked field
MAX_GROUPS = 4096  # (handle, numbers) groups in one end_handouts frame; the client splits
MAX_ERROR_CHARS = 4096  # an error message is cut here (a key quoted in it may be 1 MiB)
MAX_FIELD_BYTES = 4096  # an error's str/bytes attribute longer than this goes as None

KEY, KEYS, HANDLE, HANDOUT, NUMBER, MAYBE_NUMBER, NUMBERS, GROUPS, FLAG, MAYBE_FIELD = (
    "key", "keys", "handle", "handout", "number", "number?", "numbers", "groups", "flag",
    "field?")


@dataclass(frozen=True)
class Op:
    """One operation: the kinds of its arguments, and whether a client may post it."""

    args: tuple[str, ...] = ()
    postable: bool = False


OPS: dict[str, Op] = {
    "hello": Op(),  # -> [protocol, name, n_readers, max_object_bytes]
    "len": Op(),
    "cached": Op((KEYS,)),
    "hand_out_cached": Op((KEYS, MAYBE_FIELD)),  # -> per key: a hand-out, or None
    "hand_out": Op((HANDLE,)),  # -> a hand-out
    "issued": Op((KEY, HANDOUT)),
    "give_back": Op((HANDLE, MAYBE_NUMBER), postable=True),
    "narrow": Op((HANDLE, NUMBER, NUMBERS), postable=True),
    "end_handouts": Op((GROUPS,)),
    "unread": Op((HANDLE,)),
    "withdraw": Op((HANDLE,)),
    "clear": Op((FLAG,)),
    "begin": Op((KEY, NUMBER, NUMBER)),  # key, body bytes, structure crc -> [loan, offset]
    "commit": Op((NUMBER,)),  # loan -> a hand-out
    "commit_unowed": Op((NUMBER,)),  # loan -> its handle; the hand-out given back at once
    "abandon": Op((NUMBER,)),  # loan
}
POSTABLE = tuple(name for name, op in OPS.items() if op.postable)

# errors that cross the socket: class and the attributes its constructor takes after the
# message, rebuilt on the client's side with them
ERRORS: dict[str, tuple[type[ShmStoreError], tuple[str, ...]]] = {
    "StaleHandle": (StaleHandle, ("handle", "name")),
    "KeyNotCached": (KeyNotCached, ("key",)),
    "KeyExists": (KeyExists, ("key",)),
    "ObjectTooLarge": (ObjectTooLarge, ("object_bytes", "max_object_bytes")),
    "StoreFull": (StoreFull, ("requested_bytes", "capacity_bytes", "lagging_readers")),
    "ReaderIndexError": (ReaderIndexError, ("reader", "n_readers")),
    "InvalidKey": (InvalidKey, ()),
    "InvalidHandle": (InvalidHandle, ()),
    "InvalidArgument": (InvalidArgument, ("argument", "value")),
}


def _field_to_wire(value: Any) -> Any:
    if isinstance(value, Handle):
        return ["handle", handle_to_wire(value)]
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, (str, bytes)) and len(value) > MAX_FIELD_BYTES:
        return None
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value[:MAX_FIELD_BYTES // 8]
    return None  # anything else stays on the host's side


def error_reply(exc: BaseException) -> list[Any]:
    """The reply of a call that raised `exc`: bounded, with the attributes ERRORS names."""
    name = type(exc).__name__
    fields = [_field_to_wire(getattr(exc, a, None)) for a in ERRORS.get(name, (None, ()))[1]]
    return [1, name, str(exc)[:MAX_ERROR_CHARS], fields]


def rebuild_error(reply: list[Any], key: Any = None) -> ShmStoreError:
    """The exception an error reply stands for; `key` (the call's own) where the host left a
    long key out."""
    name, message, fields = (reply + ["", "", []])[1:4]
    if name not in ERRORS or not isinstance(fields, list):
        return ShmStoreError(f"{name}: {message}")
    cls, attrs = ERRORS[name]
    values = []
    for attr, value in zip(attrs, fields + [None] * len(attrs)):
        if isinstance(value, list) and value[:1] == ["handle"]:
            try:
                value = handle_from_wire(value[1])
            except (ProtocolError, IndexError):
                value = None
        elif attr == "key" and value is None:
            value = key if key is not None else ""
        elif attr == "lagging_readers":
            value = tuple(value or ())
        values.append(value)
    return cls(str(message), *values)


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


def handout_to_wire(handout: HandOut) -> list[Any]:
    return [list(handout.to_words()), handout.record]


def handout_from_wire(value: Any, max_record: int) -> HandOut:
    """A hand-out as the other side sent it (ProtocolError: that side is not ours): its words
    (HandOut.from_words) with a number >= 1, and a record of at most `max_record` bytes."""
    if not isinstance(value, list) or len(value) != 2:
        raise ProtocolError("a hand-out is [words, record]")
    words, record = value
    if record is not None and (type(record) is not bytes or len(record) > max_record):
        raise ProtocolError(f"a hand-out's record is None or at most {max_record} bytes")
    try:
        handout = HandOut.from_words(words, record)
    except ShmStoreError as exc:
        raise ProtocolError(f"bad hand-out: {exc}") from None
    if handout.number == 0:
        raise ProtocolError("a hand-out's number is an int in [1, 2**64)")
    return handout


def int_list(values: Any, what: str) -> list[int]:
    """A reply's list of non-negative ints (ProtocolError: the host is not ours)."""
    if not isinstance(values, list) or any(type(v) is not int or v < 0 for v in values):
        raise ProtocolError(f"{what}: a list of non-negative ints")
    return values


def _number(value: Any) -> int:
    if type(value) is not int or not -(1 << 63) <= value < 1 << 64:
        raise ProtocolError(f"a number is an int in [-2**63, 2**64), not {type(value).__name__}")
    return value


def _numbers(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise ProtocolError("numbers: a list")
    return [_number(v) for v in value]


def _handle_arg(value: Any) -> Handle:
    """A handle argument: its shape checked here (ProtocolError), its values by Handle
    (InvalidHandle, answered)."""
    if not isinstance(value, list) or len(value) != 4:
        raise ProtocolError("a handle is a list of 4 fields")
    return Handle(*value)


def _keys(value: Any) -> list[str | bytes]:
    if not isinstance(value, list) or len(value) > MAX_KEYS:
        raise ProtocolError(f"a list of at most {MAX_KEYS} keys")
    for key in value:  # all checked first: a bad key runs nothing
        check_key(key)
    return value


def _groups(value: Any) -> list[tuple[Handle, list[int]]]:
    if not isinstance(value, list) or any(not isinstance(g, list) or len(g) != 2 for g in value):
        raise ProtocolError("a list of [handle, numbers]")
    if len(value) > MAX_GROUPS:
        raise ProtocolError(f"at most {MAX_GROUPS} groups in one frame")
    return [(_handle_arg(h), _numbers(n)) for h, n in value]


def check_field(field: Any) -> str:
    """A peeked field's name: a str of 1 to MAX_FIELD_CHARS characters (InvalidArgument)."""
    if type(field) is not str or not 0 < len(field) <= MAX_FIELD_CHARS:
        raise InvalidArgument(f"a peeked field is named by a str of 1 to {MAX_FIELD_CHARS} "
                              f"characters, got {str(field)[:80]!r}", "field", None)
    return field


def _maybe_field(value: Any) -> str | None:
    if value is None:
        return None
    if type(value) is not str or len(value) > MAX_FIELD_CHARS:
        raise ProtocolError(f"a field is None or a str of at most {MAX_FIELD_CHARS} characters")
    return check_field(value)  # an empty one is answered (InvalidArgument)


def _handout_arg(value: Any) -> HandOut:
    """A hand-out argument (to ask whether the store issued it): [words, None]; any number
    the words carry (0 included: the store answers that it did not make it)."""
    if not isinstance(value, list) or len(value) != 2 or value[1] is not None:
        raise ProtocolError("a hand-out asked about is [words, None]")
    try:
        return HandOut.from_words(value[0])
    except InvalidHandle as exc:  # well-typed words out of range: answered, as for a handle
        words = value[0]
        if (isinstance(words, list) and len(words) == len(HANDOUT_WORDS)
                and all(type(w) is int for w in words)):
            raise
        raise ProtocolError(f"bad hand-out: {exc}") from None


def _flag(value: Any) -> bool:
    if type(value) is not bool:
        raise ProtocolError("a flag is true or false")
    return value


_FROM_WIRE: dict[str, Callable[[Any], Any]] = {
    KEY: check_key,
    KEYS: _keys,
    HANDLE: _handle_arg,
    NUMBER: _number,
    MAYBE_NUMBER: lambda v: None if v is None else _number(v),
    NUMBERS: _numbers,
    GROUPS: _groups,
    FLAG: _flag,
    MAYBE_FIELD: _maybe_field,
    HANDOUT: _handout_arg,
}
def _number_out(value: Any) -> int:
    """A number the caller passed, as the wire carries it: a bool, a float or a str is the
    caller's mistake, refused here (InvalidArgument, as the local writer refuses it) rather
    than sent for the host to drop the connection over; numpy ints go as ints."""
    return int_arg(value, "number", -(1 << 63), (1 << 64) - 1)


def _handout_out(handout: HandOut) -> HandOut:
    """A hand-out the caller passed, as the wire carries it: not a HandOut, or a number that
    is not an int, is the caller's mistake (InvalidArgument); an object id of another size
    is InvalidHandle (HandOut.to_words), as a Handle's bad field is."""
    if type(handout) is not HandOut:
        raise InvalidArgument(f"a HandOut is asked about, got {type(handout).__name__}",
                              "handout", handout)
    number = _number_out(handout.number)
    return handout._replace(number=max(number, 0))  # never handed out: 0 is never either


_TO_WIRE: dict[str, Callable[[Any], Any]] = {
    HANDLE: handle_to_wire,
    KEYS: list,
    NUMBER: _number_out,
    MAYBE_NUMBER: lambda v: None if v is None else _number_out(v),
    NUMBERS: lambda values: [_number_out(v) for v in values],
    GROUPS: lambda groups: [[handle_to_wire(h), list(n)] for h, n in groups],
    FLAG: bool,
    HANDOUT: lambda h: [list(_handout_out(h).to_words()), None],
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


def send_frame(sock: socket.socket, obj: Any, limit: int = MAX_FRAME_BYTES) -> None:
    """Send one request or reply (local/_frames.py), refused over `limit` bytes."""
    frames.send_frame(sock, obj, limit=limit, what=f"{obj[0]!r} request",
                      advice="use shorter keys (a content hash) or fewer at once")


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> Any:
    """The next frame, None when the peer closed; ProtocolError for a frame out of bounds."""
    return frames.recv_frame(sock, limit=limit)

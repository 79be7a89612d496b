"""Decoding a serde body: every count, length, offset, dtype and shape checked before use."""

from __future__ import annotations

import math
import warnings
import zlib
from typing import Any

import msgpack
import numpy as np

from ..errors import CorruptObject, InvalidHandle
from ..handle import HANDLE_WIRE, Handle
from ._types import (
    BODY_HEADER,
    BODY_MAGIC,
    BUFFER_ALIGN_BYTES,
    BUFFER_ENTRY,
    EXT_HANDLE,
    EXT_NDARRAY,
    EXT_SCALAR,
    EXT_TENSOR,
    EXT_TUPLE,
    MAX_DIM,
    MAX_NDIM,
    NUMPY_DTYPES,
    TORCH_ITEMSIZES,
    import_torch,
    torch_dtype_table,
)

__all__ = ["decode", "check_body", "peek"]


class _TupleMark:
    """What EXT_TUPLE decodes to; list_hook turns [mark, *items] into a tuple."""


_TUPLE_MARK = _TupleMark()


class _Decoder:
    def __init__(self, body: memoryview, copy: bool, pin_memory: bool = False,
                 build: bool = True) -> None:
        self.body = body
        self.build = build  # False: check every extension, build no array (and import nothing)
        self.copy = copy
        self.pin_memory = pin_memory
        self.table: list[tuple[int, int]] = []
        self.open_marks = 0  # tuple marks not (yet) at the head of an array

    def list_hook(self, items: list[Any]) -> Any:
        if items and items[0] is _TUPLE_MARK:
            self.open_marks -= 1
            return tuple(items[1:])
        return items

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_NDARRAY:
            dtype_str, shape, index = self.meta(data, 3)
            dtype = NUMPY_DTYPES.get(dtype_str) if type(dtype_str) is str else None
            if dtype is None:
                raise CorruptObject(f"array dtype {dtype_str!r} is not one shmstore writes")
            offset, count = self.buffer(index, shape, dtype.itemsize)
            if not self.build:
                return None
            if count == 0:
                return np.empty(shape, dtype=dtype)
            arr = np.frombuffer(self.body, dtype=dtype, count=count, offset=offset).reshape(shape)
            if self.copy:
                return arr.copy()
            arr.flags.writeable = False
            return arr
        if code == EXT_TENSOR:
            name, shape, index = self.meta(data, 3)
            if not self.build:
                size = TORCH_ITEMSIZES.get(name) if type(name) is str else None
                if size is None:
                    raise CorruptObject(f"tensor dtype {name!r} is not one shmstore writes")
                self.buffer(index, shape, size)
                return None
            entry = torch_dtype_table().get(name) if type(name) is str else None
            if entry is None:
                raise CorruptObject(f"tensor dtype {name!r} is not one shmstore writes")
            dtype, itemsize = entry
            torch = import_torch()
            offset, count = self.buffer(index, shape, itemsize)
            if count == 0:
                return torch.empty(shape, dtype=dtype)
            if self.copy:  # one memcpy into a fresh tensor, whatever the source buffer is
                out = torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
                nbytes = count * itemsize
                memoryview(out.view(-1).view(torch.uint8).numpy())[:] = (
                    self.body[offset:offset + nbytes])
                return out
            if self.body.readonly:  # torch warns on read-only buffers; these views are read-only
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    t = torch.frombuffer(self.body, dtype=dtype, count=count, offset=offset)
            else:
                t = torch.frombuffer(self.body, dtype=dtype, count=count, offset=offset)
            return t.view(shape)
        if code == EXT_TUPLE:
            if data:
                raise CorruptObject(f"a tuple mark holds {len(data)} bytes, not 0")
            self.open_marks += 1
            return _TUPLE_MARK
        if code == EXT_SCALAR:
            dtype_str, raw = self.meta(data, 2)
            dtype = NUMPY_DTYPES.get(dtype_str) if type(dtype_str) is str else None
            if dtype is None or type(raw) is not bytes or len(raw) != dtype.itemsize:
                raise CorruptObject(f"bad numpy scalar {dtype_str!r} of {len(raw)} bytes")
            return np.frombuffer(raw, dtype=dtype)[0]
        if code == EXT_HANDLE:
            if len(data) != HANDLE_WIRE.size:
                raise CorruptObject(f"a Handle extension is {HANDLE_WIRE.size} bytes, got {len(data)}")
            try:
                return Handle.unpack(data)
            except InvalidHandle as exc:
                raise CorruptObject(str(exc)) from None
        raise CorruptObject(f"unknown msgpack extension code {code}")

    @staticmethod
    def meta(data: bytes, n: int) -> list[Any]:
        items = msgpack.unpackb(data, raw=False)
        if type(items) is not list or len(items) != n:
            raise CorruptObject(f"extension metadata is not a list of {n} items")
        return items

    def buffer(self, index: Any, shape: Any, itemsize: int) -> tuple[int, int]:
        if type(index) is not int or not 0 <= index < len(self.table):
            raise CorruptObject(f"buffer index {index!r} is outside the table of {len(self.table)}")
        if (type(shape) is not list or len(shape) > MAX_NDIM
                or any(type(d) is not int or not 0 <= d < MAX_DIM for d in shape)):
            raise CorruptObject(f"bad array shape {shape!r:.200}")
        count = math.prod(shape)
        offset, nbytes = self.table[index]
        if count * itemsize != nbytes:
            raise CorruptObject(f"shape {shape} of {itemsize}-byte items needs {count * itemsize} "
                                f"bytes, the buffer holds {nbytes}")
        return offset, count


def decode(body: memoryview, *, copy: bool = True, expected_crc: int | None = None,
           crc_suffix: bytes = b"", pin_memory: bool = False) -> Any:
    """Rebuild an object from its body.

    Args:
        body: the encoded bytes, exactly (a memoryview into shared memory for zero copy).
        copy: True returns owned arrays/tensors; False returns views into `body`, valid only while
            the bytes stay unchanged.
        expected_crc: when given, the CRC-32 of the header, buffer table and msgpack structure
            (`Encoded.structure_crc`), continued over `crc_suffix`, must equal it.
        pin_memory: with `copy`, torch tensors are made in page-locked memory (CUDA only: a
            device copy from them needs no staging copy); numpy arrays are not affected.

    Raises:
        CorruptObject: any length, offset, dtype or shape that does not fit the body.
    """
    if expected_crc is None and len(body) >= BODY_HEADER.size:
        # A body of msgpack's own types only (most queue messages) needs no decoder and no
        # hook: one unpack. Anything else, an extension or damage, takes the full path below,
        # which finds the same value or says what is wrong.
        magic, n_buffers, struct_bytes = BODY_HEADER.unpack_from(body, 0)
        if magic == BODY_MAGIC and n_buffers == 0 and struct_bytes <= len(body) - BODY_HEADER.size:
            try:
                return msgpack.unpackb(body[BODY_HEADER.size:BODY_HEADER.size + struct_bytes],
                                       ext_hook=_no_extension, raw=False, strict_map_key=False)
            except (_HasExtension, *_FORMAT_ERRORS):  # the full path builds it or says why not
                pass
    return _unpack(body, _Decoder(body, copy, pin_memory), expected_crc, crc_suffix)


# What unpacking a damaged structure raises: msgpack's format errors (and StackError, for
# nesting beyond 1024) are ValueErrors; unhashable keys are TypeErrors; numpy/torch reject
# impossible shapes with the others. Anything else (a signal handler's own exception) goes on up.
_FORMAT_ERRORS = (ValueError, TypeError, OverflowError, RecursionError, MemoryError, RuntimeError)


def _no_extension(code: int, data: bytes) -> Any:
    raise _HasExtension


class _HasExtension(Exception):
    """What the short path of decode() raises at an extension: the full path builds it."""


def check_body(body: memoryview) -> None:
    """Make every check decode() makes on `body`, building no array or tensor and importing
    nothing (torch's first import takes seconds: a relay must not stall on it).

    Raises:
        CorruptObject: as decode().
    """
    _unpack(body, _Decoder(body, copy=False, build=False), None, b"")


def peek(body: memoryview, field: str, *, expected_crc: int, crc_suffix: bytes = b"",
         max_bytes: int) -> bytes | None:
    """The bytes under `field` of the top-level map `body` holds, without building any array
    or tensor: every check of decode() is made, the structure's CRC included. None when the
    structure is not a map, has no such field, or it is not bytes of at most `max_bytes`.

    Raises:
        CorruptObject: as decode().
    """
    value = _unpack(body, _Decoder(body, copy=False, build=False), expected_crc, crc_suffix)
    found = value.get(field) if type(value) is dict else None
    return found if type(found) is bytes and len(found) <= max_bytes else None


def _unpack(body: memoryview, dec: _Decoder, expected_crc: int | None,
            crc_suffix: bytes) -> Any:
    size = len(body)
    if size < BODY_HEADER.size:
        raise CorruptObject(f"object body is {size} bytes, shorter than its {BODY_HEADER.size}-byte "
                            "header")
    magic, n_buffers, struct_bytes = BODY_HEADER.unpack_from(body, 0)
    if magic != BODY_MAGIC:
        raise CorruptObject(f"object body starts with {bytes(magic)!r}, not {BODY_MAGIC!r}")
    table_end = BODY_HEADER.size + BUFFER_ENTRY.size * n_buffers
    struct_end = table_end + struct_bytes
    if struct_end > size:
        raise CorruptObject(f"object header claims {n_buffers} buffers and a {struct_bytes}-byte "
                            f"structure, more than the {size}-byte body")
    if expected_crc is not None:
        found = zlib.crc32(crc_suffix, zlib.crc32(body[:struct_end]))
        if found != expected_crc:
            raise CorruptObject(f"object structure is damaged: CRC {found:#010x}, written as "
                                f"{expected_crc:#010x}")
    low = struct_end
    for i in range(n_buffers):
        offset, nbytes = BUFFER_ENTRY.unpack_from(body, BODY_HEADER.size + BUFFER_ENTRY.size * i)
        if offset % BUFFER_ALIGN_BYTES or offset < low or nbytes > size - offset:
            raise CorruptObject(f"buffer {i} at offset {offset} of {nbytes} bytes does not fit "
                                f"the {size}-byte body after the structure and buffer {i - 1}")
        dec.table.append((offset, nbytes))
        low = offset + nbytes
    try:
        obj = msgpack.unpackb(body[table_end:struct_end], ext_hook=dec.ext_hook,
                              list_hook=dec.list_hook, raw=False, strict_map_key=False)
    except CorruptObject:
        raise
    except _FORMAT_ERRORS as exc:
        raise CorruptObject(f"object structure is not valid: {type(exc).__name__}: "
                            f"{str(exc)[:200]}") from None
    if dec.open_marks:
        raise CorruptObject("a tuple mark appears elsewhere than at the head of an array")
    return obj

"""Serializer: msgpack for the structure, arrays and tensors out of band as raw aligned buffers.

An encoded object (its "body") is laid out as::

    offset            size        field
    0                 4           magic          b"SSB1"
    4                 4           n_buffers      u32
    8                 8           struct_bytes   u64, length of the msgpack structure
    16                16*n        buffer table   n x (offset u64, nbytes u64), offsets from body start
    16+16n            struct      msgpack structure
    (aligned to 64)   ...         buffer 0, buffer 1, ...  each starting on a cache line

The structure is plain msgpack (nil, bool, int, float, str, bin, array, map) plus extensions:

    EXT_NDARRAY  [dtype str, shape, buffer index]    numpy array, bytes in a buffer
    EXT_TENSOR   [dtype name, shape, buffer index]   torch CPU tensor, bytes in a buffer
    EXT_TUPLE    empty; first item of an array       the array is a tuple (msgpack only knows
                                                     lists); decoded by list_hook, so nesting
                                                     never recurses on the C stack
    EXT_SCALAR   [dtype str, raw bytes]              a numpy scalar
    EXT_HANDLE   Handle wire form (40 bytes)         a shmstore Handle

`encode` walks the object once (checking every type, with its path for errors) and sizes the body;
`Encoded.write_into` then copies each array once, straight from its memory into the destination.
`decode` trusts nothing: every count, length, offset, dtype and shape is checked against the body
before use and any inconsistency raises CorruptObject. No pickle anywhere. Nesting: encode refuses
more than MAX_DEPTH (100) levels; decode is bounded by msgpack's own iterative stack (1024
levels, StackError -> CorruptObject) and never recurses in C, so no body can exhaust a reader
thread's stack.

Subclasses come back as their base type (an OrderedDict as a dict, a namedtuple as a tuple).
Zero-copy numpy arrays are read-only; zero-copy torch tensors cannot be (torch has no read-only
tensors): do not write to them.
"""

from __future__ import annotations

import math
import operator
import struct
import sys
import warnings
import zlib
from typing import Any, cast

import msgpack
import numpy as np

from .errors import CorruptObject, InvalidHandle, NotSerializable
from .handle import HANDLE_WIRE, Handle

__all__ = ["Blank", "Encoded", "encode", "decode", "dumps", "loads", "BODY_HEADER",
           "BUFFER_ENTRY"]

BODY_HEADER = struct.Struct("<4sIQ")
BUFFER_ENTRY = struct.Struct("<QQ")
BODY_MAGIC = b"SSB2"
BUFFER_ALIGN_BYTES = 64  # one cache line; also what SIMD loads of every dtype want
MAX_DEPTH = 100  # nesting levels; deeper structures (or cycles) are refused
MAX_NDIM = 64  # numpy's limit
MAX_DIM = 1 << 62  # any larger dimension cannot describe bytes in memory
EXT_NDARRAY = 1
EXT_TENSOR = 2
EXT_TUPLE = 3
EXT_SCALAR = 4
EXT_HANDLE = 5
_TUPLE_EXT = msgpack.ExtType(EXT_TUPLE, b"")
_INT_MIN = -(1 << 63)
_INT_LIMIT = 1 << 64

_NUMERIC_KINDS = frozenset("biufc")
# Every numeric and bool numpy dtype in both byte orders, as dtype.str: the only dtypes decode
# will build (an arbitrary dtype string could name object or structured dtypes).
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {}
for _code in ("?", "b", "B", "h", "H", "i", "I", "l", "L", "q", "Q", "e", "f", "d", "g",
              "F", "D", "G"):
    for _dt in (np.dtype(_code), np.dtype(_code).newbyteorder()):
        _NUMPY_DTYPES[_dt.str] = _dt

_TORCH_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)
_torch_dtypes: dict[str, tuple[Any, int]] | None = None  # name -> (dtype, itemsize), lazily


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ModuleNotFoundError(
            "this object holds torch tensors but torch is not installed here: "
            "pip install 'shmstore[torch]'"
        ) from exc
    return torch


def _torch_dtype_table() -> dict[str, tuple[Any, int]]:
    global _torch_dtypes
    if _torch_dtypes is None:
        torch = _torch()
        _torch_dtypes = {
            n: (getattr(torch, n), getattr(torch, n).itemsize)
            for n in _TORCH_DTYPE_NAMES if hasattr(torch, n)
        }
    return _torch_dtypes


def _is_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _format_path(root: str, path: tuple[Any, ...]) -> str:
    return root + "".join(f"[{p!r}]" for p in path)


class Blank:
    """An array or tensor of known shape and dtype, left for the caller to fill in place.

    Only `StoreWriter.reserve` accepts blanks (see there); `dtype` is a numpy dtype (any form
    numpy accepts) or, with `torch=True`, a torch dtype or its name ("bfloat16").
    """

    __slots__ = ("dtype", "nbytes", "shape", "torch")

    def __init__(self, shape: Any, dtype: Any, *, torch: bool = False) -> None:
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise NotSerializable(f"blank shape {shape!r:.80} is not a sequence of ints",
                                  "shape") from None
        if len(dims) > MAX_NDIM or any(not 0 <= d < MAX_DIM for d in dims):
            raise NotSerializable(f"blank shape {dims!r:.80} has a negative or huge dimension, "
                                  f"or more than {MAX_NDIM}", "shape")
        self.shape = dims
        self.torch = bool(torch)
        if self.torch:
            name = str(dtype).removeprefix("torch.")
            if name not in _TORCH_DTYPE_NAMES:
                raise NotSerializable(f"blank torch dtype {dtype!r} is not supported", "dtype")
            self.dtype: Any = name
            itemsize = _torch_dtype_table()[name][1]
        else:
            try:
                np_dtype = np.dtype(dtype)
            except TypeError:
                raise NotSerializable(f"blank dtype {dtype!r:.40} is not a numpy dtype",
                                      "dtype") from None
            if np_dtype.str not in _NUMPY_DTYPES:
                raise NotSerializable(f"blank dtype {np_dtype} is not supported (bool and "
                                      "numeric dtypes only)", "dtype")
            self.dtype = np_dtype
            itemsize = np_dtype.itemsize
        self.nbytes = math.prod(dims) * itemsize

    def __repr__(self) -> str:
        return f"Blank({self.shape}, {self.dtype}{', torch=True' if self.torch else ''})"


class _Encoder:
    """One walk over an object: msgpack-ready structure plus the list of out-of-band buffers."""

    def __init__(self, root: str, blanks: bool = False) -> None:
        self.root = root
        self.sources: list[Any] = []  # numpy arrays, torch tensors or Blanks, in buffer order
        self.sizes: list[int] = []
        self.blanks = blanks
        self.paths: list[tuple[Any, ...]] = []  # where each source sits in the object

    def fail(self, path: tuple[Any, ...], obj: object, why: str) -> NotSerializable:
        where = _format_path(self.root, path)
        return NotSerializable(f"cannot serialize {type(obj).__module__}.{type(obj).__qualname__} "
                               f"at {where}: {why}", where)

    def walk(self, obj: Any, path: tuple[Any, ...], depth: int) -> Any:
        kind = type(obj)
        if obj is None or kind is bool or kind is float or kind is str or kind is bytes:
            return obj
        if kind is int:
            if not _INT_MIN <= obj < _INT_LIMIT:
                raise self.fail(path, obj, f"int {obj} does not fit in 64 bits; send it as a str "
                                "or a numpy array")
            return obj
        if depth >= MAX_DEPTH:
            raise self.fail(path, obj, f"nested deeper than {MAX_DEPTH} levels (or cyclic)")
        if kind is list:
            return [self.walk(v, path + (i,), depth + 1) for i, v in enumerate(obj)]
        if kind is dict:
            out = {}
            for k, v in obj.items():
                if not (k is None or type(k) in (str, bytes, int, float, bool)):
                    raise self.fail(path + (k,), k, "dict keys must be str, bytes, int, float, "
                                    "bool or None")
                out[self.walk(k, path, depth + 1)] = self.walk(v, path + (k,), depth + 1)
            return out
        if kind is tuple:
            return [_TUPLE_EXT, *(self.walk(v, path + (i,), depth + 1) for i, v in enumerate(obj))]
        if kind is np.ndarray:
            return self.array(obj, path)
        if kind is Blank:
            return self.blank(obj, path)
        if kind is Handle:
            return msgpack.ExtType(EXT_HANDLE, obj.pack())
        if _is_tensor(obj):
            return self.tensor(obj, path)
        if isinstance(obj, np.generic):
            if obj.dtype.kind not in _NUMERIC_KINDS:
                raise self.fail(path, obj, f"numpy scalars of dtype {obj.dtype} are not supported")
            return msgpack.ExtType(EXT_SCALAR, msgpack.packb([obj.dtype.str, obj.tobytes()]))
        # Subclasses of the plain types travel as their base type (masked arrays would lose data).
        if isinstance(obj, np.ndarray) and not isinstance(obj, np.ma.MaskedArray):
            return self.array(np.asarray(obj), path)
        for base in (int, float, str, bytes, list, dict, tuple):
            if isinstance(obj, base):
                return self.walk(cast(Any, base)(obj), path, depth)
        raise self.fail(path, obj, "supported are None, bool, int, float, str, bytes, list, tuple, "
                        "dict, numpy arrays and scalars, torch CPU tensors and Handle")

    def blank(self, blank: Blank, path: tuple[Any, ...]) -> msgpack.ExtType:
        if not self.blanks:
            raise self.fail(path, blank, "a Blank is a placeholder for StoreWriter.reserve; "
                            "put() and send() need the data itself")
        index = self.add(blank, blank.nbytes, path)
        if blank.torch:
            return msgpack.ExtType(EXT_TENSOR, msgpack.packb([blank.dtype, list(blank.shape),
                                                              index]))
        return msgpack.ExtType(EXT_NDARRAY, msgpack.packb([blank.dtype.str, list(blank.shape),
                                                           index]))

    def add(self, source: Any, nbytes: int, path: tuple[Any, ...]) -> int:
        self.sources.append(source)
        self.sizes.append(nbytes)
        self.paths.append(path)
        return len(self.sources) - 1

    def array(self, arr: np.ndarray, path: tuple[Any, ...]) -> msgpack.ExtType:
        if arr.dtype.kind not in _NUMERIC_KINDS or arr.dtype.str not in _NUMPY_DTYPES:
            raise self.fail(path, arr, f"arrays of dtype {arr.dtype} are not supported (only bool "
                            "and numeric dtypes)")
        index = self.add(arr, arr.nbytes, path)
        return msgpack.ExtType(EXT_NDARRAY, msgpack.packb([arr.dtype.str, list(arr.shape), index]))

    def tensor(self, t: Any, path: tuple[Any, ...]) -> msgpack.ExtType:
        name = str(t.dtype).removeprefix("torch.")
        if t.device.type != "cpu":
            raise self.fail(path, t, f"the tensor is on {t.device}; move it to the CPU first "
                            "(tensor.cpu())")
        if t.layout is not _torch().strided:
            raise self.fail(path, t, f"{t.layout} tensors are not supported; use .to_dense()")
        if name not in _torch_dtype_table():  # e.g. quantized or sub-byte dtypes
            raise self.fail(path, t, f"tensors of dtype {t.dtype} are not supported")
        t = t.detach().resolve_conj().resolve_neg()
        index = self.add(t, t.numel() * t.element_size(), path)
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb([name, list(t.shape), index]))


class Encoded:
    """An object ready to be written: its size is known, its arrays not yet copied.

    Holds references to the source arrays until written; write it before changing them.
    """

    __slots__ = ("_buffers", "_prefix", "blanks", "nbytes")

    def __init__(self, prefix: bytes, buffers: list[tuple[int, Any]], nbytes: int,
                 blanks: list[tuple[tuple[Any, ...], int, Blank]] | None = None) -> None:
        self.nbytes = nbytes
        self._prefix = prefix
        self._buffers = buffers  # (offset in body, numpy array or torch tensor)
        self.blanks = blanks or []  # (path in the object, offset in body, Blank)

    @property
    def structure_crc(self) -> int:
        """CRC-32 of everything but the raw array bytes (header, buffer table, msgpack)."""
        return zlib.crc32(self._prefix)

    def blank_views(self, dst: memoryview) -> list[tuple[tuple[Any, ...], Any]]:
        """(path, writable array or tensor) for each Blank, viewing its place in `dst`."""
        views = []
        for path, offset, blank in self.blanks:
            if blank.torch:
                torch = _torch()
                dtype = _torch_dtype_table()[blank.dtype][0]
                if blank.nbytes == 0:
                    views.append((path, torch.empty(blank.shape, dtype=dtype)))
                    continue
                count = blank.nbytes // _torch_dtype_table()[blank.dtype][1]
                views.append((path, torch.frombuffer(dst, dtype=dtype, count=count,
                                                     offset=offset).view(blank.shape)))
            elif blank.nbytes == 0:
                views.append((path, np.empty(blank.shape, dtype=blank.dtype)))
            else:
                views.append((path, np.frombuffer(dst, dtype=blank.dtype, count=math.prod(
                    blank.shape), offset=offset).reshape(blank.shape)))
        return views

    def write_into(self, dst: memoryview) -> None:
        """Write the body into `dst` (at least `nbytes`; 64-byte aligned for aligned arrays).
        The bytes of Blanks are left as they are (their owner fills them)."""
        if len(dst) < self.nbytes:
            raise ValueError(f"destination holds {len(dst)} bytes, the object needs {self.nbytes}")
        dst[:len(self._prefix)] = self._prefix
        for offset, src in self._buffers:
            if type(src) is Blank:
                continue
            if isinstance(src, np.ndarray):
                view = np.frombuffer(dst, dtype=src.dtype, count=src.size, offset=offset)
                np.copyto(view.reshape(src.shape), src, casting="no")
            else:  # a torch tensor: copy_ takes any strides, so non-contiguous input is copied once
                torch = _torch()
                view = torch.frombuffer(dst, dtype=src.dtype, count=src.numel(), offset=offset)
                view.view(src.shape).copy_(src)


def encode(obj: Any, *, root: str = "obj", blanks: bool = False) -> Encoded:
    """Check and size `obj`; return an Encoded to write with `write_into`.

    Raises:
        NotSerializable: an unsupported type, an int outside 64 bits, nesting deeper than
            MAX_DEPTH or a str that is not valid Unicode, with its path (obj['pixel_values'][2]);
            a Blank unless `blanks` (StoreWriter.reserve).
    """
    enc = _Encoder(root, blanks)
    tree = enc.walk(obj, (), 0)
    try:
        structure = msgpack.packb(tree)
    except UnicodeEncodeError:
        where = _format_path(root, _bad_str_path(obj, ()) or ())
        raise NotSerializable(f"cannot serialize the str at {where}: it is not valid Unicode (a "
                              "lone surrogate); encode it with errors='surrogatepass' and send "
                              "bytes", where) from None
    n_buffers = len(enc.sources)
    table_end = BODY_HEADER.size + BUFFER_ENTRY.size * n_buffers
    nbytes = table_end + len(structure)
    prefix = bytearray(table_end)
    BODY_HEADER.pack_into(prefix, 0, BODY_MAGIC, n_buffers, len(structure))
    buffers: list[tuple[int, Any]] = []
    blank_list: list[tuple[tuple[Any, ...], int, Blank]] = []
    for i, (src, size) in enumerate(zip(enc.sources, enc.sizes)):
        offset = (nbytes + BUFFER_ALIGN_BYTES - 1) & ~(BUFFER_ALIGN_BYTES - 1)
        BUFFER_ENTRY.pack_into(prefix, BODY_HEADER.size + BUFFER_ENTRY.size * i, offset, size)
        if type(src) is Blank:
            blank_list.append((enc.paths[i], offset, src))
        elif size:
            buffers.append((offset, src))
        nbytes = offset + size
    return Encoded(bytes(prefix) + structure, buffers, nbytes, blank_list)


def _bad_str_path(obj: Any, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Where in `obj` a str that UTF-8 cannot encode is (the slow path of an encode error)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            found = _bad_str_path(k, path) if isinstance(k, str) else None
            found = found if found is not None else _bad_str_path(v, path + (k,))
            if found is not None:
                return found
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found = _bad_str_path(v, path + (i,))
            if found is not None:
                return found
    return None


def dumps(obj: Any) -> bytes:
    """Serialize `obj` to bytes (two copies; the store writes into shared memory directly)."""
    enc = encode(obj)
    out = bytearray(enc.nbytes)
    enc.write_into(memoryview(out))
    return bytes(out)


def loads(data: bytes | bytearray | memoryview, *, copy: bool = True) -> Any:
    """Deserialize bytes made by `dumps` (or a body in shared memory); see `decode`."""
    return decode(memoryview(data), copy=copy)


class _TupleMark:
    """What EXT_TUPLE decodes to; list_hook turns [mark, *items] into a tuple."""


_TUPLE_MARK = _TupleMark()


class _Decoder:
    def __init__(self, body: memoryview, copy: bool) -> None:
        self.body = body
        self.copy = copy
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
            dtype = _NUMPY_DTYPES.get(dtype_str) if type(dtype_str) is str else None
            if dtype is None:
                raise CorruptObject(f"array dtype {dtype_str!r} is not one shmstore writes")
            offset, count = self.buffer(index, shape, dtype.itemsize)
            if count == 0:
                return np.empty(shape, dtype=dtype)
            arr = np.frombuffer(self.body, dtype=dtype, count=count, offset=offset).reshape(shape)
            if self.copy:
                return arr.copy()
            arr.flags.writeable = False
            return arr
        if code == EXT_TENSOR:
            name, shape, index = self.meta(data, 3)
            entry = _torch_dtype_table().get(name) if type(name) is str else None
            if entry is None:
                raise CorruptObject(f"tensor dtype {name!r} is not one shmstore writes")
            dtype, itemsize = entry
            torch = _torch()
            offset, count = self.buffer(index, shape, itemsize)
            if count == 0:
                return torch.empty(shape, dtype=dtype)
            if self.copy:  # one memcpy into a fresh tensor, whatever the source buffer is
                out = torch.empty(shape, dtype=dtype)
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
            dtype = _NUMPY_DTYPES.get(dtype_str) if type(dtype_str) is str else None
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
           crc_suffix: bytes = b"") -> Any:
    """Rebuild an object from its body.

    Args:
        body: the encoded bytes, exactly (a memoryview into shared memory for zero copy).
        copy: True returns owned arrays/tensors; False returns views into `body`, valid only while
            the bytes stay unchanged.
        expected_crc: when given, the CRC-32 of the header, buffer table and msgpack structure
            (`Encoded.structure_crc`), continued over `crc_suffix`, must equal it.

    Raises:
        CorruptObject: any length, offset, dtype or shape that does not fit the body.
    """
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
    dec = _Decoder(body, copy)
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
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError,
            RuntimeError) as exc:
        # msgpack's format errors (and StackError, for nesting beyond 1024) are ValueErrors;
        # unhashable keys are TypeErrors; numpy/torch reject impossible shapes with the others
        raise CorruptObject(f"object structure is not valid: {type(exc).__name__}: "
                            f"{str(exc)[:200]}") from None
    if dec.open_marks:
        raise CorruptObject("a tuple mark appears elsewhere than at the head of an array")
    return obj

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
import zlib
from collections.abc import Callable
from typing import Any, cast

import msgpack
import numpy as np

from ..errors import NotSerializable
from ..handle import Handle
from ._decode import check_body, decode
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
    MAX_DEPTH,
    MAX_DIM,
    MAX_NDIM,
    NUMERIC_KINDS,
    NUMPY_DTYPES,
    TORCH_DTYPE_NAMES,
    import_torch,
    is_tensor,
    torch_dtype_table,
)

__all__ = ["Blank", "Encoded", "Verbatim", "encode", "decode", "dumps", "loads", "materialize",
           "blank_key", "BODY_HEADER",
           "BUFFER_ENTRY", "BODY_MAGIC", "BUFFER_ALIGN_BYTES", "MAX_DEPTH", "EXT_NDARRAY",
           "EXT_TENSOR", "EXT_TUPLE", "EXT_SCALAR", "EXT_HANDLE"]

_TUPLE_EXT = msgpack.ExtType(EXT_TUPLE, b"")
# One packer for every encode: msgpack.packb makes a packer, and so allocates and frees its
# buffer, per call (a mapping of its own: tens of microseconds on a CPU that was idle). Each
# pack() is one call into msgpack's C code with no Python callback (no `default`), so under
# the GIL no two packs interleave; on an error it resets its buffer itself.
_PACK = msgpack.Packer().pack
_INT_MIN = -(1 << 63)
_INT_LIMIT = 1 << 64
_DTYPE_NAMES = {dtype: name for name, dtype in NUMPY_DTYPES.items()}  # dtype -> its .str
# Taken as they are. msgpack itself refuses an int outside 64 bits (OverflowError) and a str
# UTF-8 cannot encode; encode() then finds the value's path for the error.
_LEAVES = frozenset({type(None), bool, int, float, str, bytes})


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
            if name not in TORCH_DTYPE_NAMES:
                raise NotSerializable(f"blank torch dtype {dtype!r} is not supported", "dtype")
            self.dtype: Any = name
            itemsize = torch_dtype_table()[name][1]
        else:
            try:
                np_dtype = np.dtype(dtype)
            except TypeError:
                raise NotSerializable(f"blank dtype {dtype!r:.40} is not a numpy dtype",
                                      "dtype") from None
            if np_dtype.str not in NUMPY_DTYPES:
                raise NotSerializable(f"blank dtype {np_dtype} is not supported (bool and "
                                      "numeric dtypes only)", "dtype")
            self.dtype = np_dtype
            itemsize = np_dtype.itemsize
        self.nbytes = math.prod(dims) * itemsize

    def __repr__(self) -> str:
        return f"Blank({self.shape}, {self.dtype}{', torch=True' if self.torch else ''})"


def blank_key(path: tuple[Any, ...]) -> Any:
    """How a Blank at `path` is named in `arrays`: its dict key at the top level, else the path."""
    return path[0] if len(path) == 1 else path


def materialize(template: Any) -> tuple[Any, dict[Any, Any]]:
    """`template` with each Blank replaced by a fresh, uninitialised array or tensor in this
    process's memory, and those arrays named as StoreWriter.reserve names them."""
    arrays: dict[Any, Any] = {}

    def walk(obj: Any, path: tuple[Any, ...]) -> Any:
        if type(obj) is Blank:
            if obj.torch:
                made: Any = import_torch().empty(obj.shape, dtype=torch_dtype_table()[obj.dtype][0])
            else:
                made = np.empty(obj.shape, dtype=obj.dtype)
            arrays[blank_key(path)] = made
            return made
        if type(obj) is dict:
            return {k: walk(v, path + (k,)) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            items = [walk(v, path + (i,)) for i, v in enumerate(obj)]
            return items if type(obj) is list else tuple(items)
        return obj

    return walk(template, ()), arrays


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
        if kind in _LEAVES:
            return obj
        if depth >= MAX_DEPTH:
            raise self.fail(path, obj, f"nested deeper than {MAX_DEPTH} levels (or cyclic)")
        # Containers: leaves (the common case) are taken inline, without a call or a path.
        if kind is list:
            return [v if type(v) in _LEAVES else self.walk(v, path + (i,), depth + 1)
                    for i, v in enumerate(obj)]
        if kind is dict:
            out = {}
            for k, v in obj.items():
                if type(k) not in _LEAVES:
                    raise self.fail(path + (k,), k, "dict keys must be str, bytes, int, float, "
                                    "bool or None")
                out[k] = v if type(v) in _LEAVES else self.walk(v, path + (k,), depth + 1)
            return out
        if kind is tuple:
            return [_TUPLE_EXT, *(v if type(v) in _LEAVES else self.walk(v, path + (i,), depth + 1)
                                  for i, v in enumerate(obj))]
        if kind is np.ndarray:
            return self.array(obj, path)
        if kind is Blank:
            return self.blank(obj, path)
        if kind is Handle:
            return msgpack.ExtType(EXT_HANDLE, obj.pack())
        if is_tensor(obj):
            return self.tensor(obj, path)
        if isinstance(obj, np.generic):
            if obj.dtype.kind not in NUMERIC_KINDS:
                raise self.fail(path, obj, f"numpy scalars of dtype {obj.dtype} are not supported")
            return msgpack.ExtType(EXT_SCALAR, _PACK([obj.dtype.str, obj.tobytes()]))
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
            return msgpack.ExtType(EXT_TENSOR, _PACK([blank.dtype, list(blank.shape),
                                                              index]))
        return msgpack.ExtType(EXT_NDARRAY, _PACK([blank.dtype.str, list(blank.shape),
                                                           index]))

    def add(self, source: Any, nbytes: int, path: tuple[Any, ...]) -> int:
        self.sources.append(source)
        self.sizes.append(nbytes)
        self.paths.append(path)
        return len(self.sources) - 1

    def array(self, arr: np.ndarray, path: tuple[Any, ...]) -> msgpack.ExtType:
        name = _DTYPE_NAMES.get(arr.dtype)
        if name is None:
            raise self.fail(path, arr, f"arrays of dtype {arr.dtype} are not supported (only bool "
                            "and numeric dtypes)")
        index = self.add(arr, arr.nbytes, path)
        return msgpack.ExtType(EXT_NDARRAY, _PACK([name, list(arr.shape), index]))

    def tensor(self, t: Any, path: tuple[Any, ...]) -> msgpack.ExtType:
        name = str(t.dtype).removeprefix("torch.")
        if t.device.type != "cpu":
            raise self.fail(path, t, f"the tensor is on {t.device}; move it to the CPU first "
                            "(tensor.cpu())")
        if t.layout is not import_torch().strided:
            raise self.fail(path, t, f"{t.layout} tensors are not supported; use .to_dense()")
        if name not in torch_dtype_table():  # e.g. quantized or sub-byte dtypes
            raise self.fail(path, t, f"tensors of dtype {t.dtype} are not supported")
        t = t.detach().resolve_conj().resolve_neg()
        index = self.add(t, t.numel() * t.element_size(), path)
        return msgpack.ExtType(EXT_TENSOR, _PACK([name, list(t.shape), index]))


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
                torch = import_torch()
                dtype = torch_dtype_table()[blank.dtype][0]
                if blank.nbytes == 0:
                    views.append((path, torch.empty(blank.shape, dtype=dtype)))
                    continue
                count = blank.nbytes // torch_dtype_table()[blank.dtype][1]
                views.append((path, torch.frombuffer(dst, dtype=dtype, count=count,
                                                     offset=offset).view(blank.shape)))
            elif blank.nbytes == 0:
                views.append((path, np.empty(blank.shape, dtype=blank.dtype)))
            else:
                views.append((path, np.frombuffer(dst, dtype=blank.dtype, count=math.prod(
                    blank.shape), offset=offset).reshape(blank.shape)))
        return views

    def whole(self) -> bytes | memoryview | None:
        """The whole body as one buffer where it is one already (no arrays), else None."""
        return self._prefix if not self._buffers and len(self._prefix) == self.nbytes else None

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
                if src.flags.c_contiguous:  # one memcpy, without numpy's copy machinery
                    try:
                        raw = src.data.cast("B")
                    except ValueError:  # a dtype the buffer interface cannot show (non-native
                        pass            # long double, say): numpy copies it below
                    else:
                        dst[offset:offset + src.nbytes] = raw
                        continue
                view = np.frombuffer(dst, dtype=src.dtype, count=src.size, offset=offset)
                np.copyto(view.reshape(src.shape), src, casting="no")
            else:  # a torch tensor: copy_ takes any strides, so non-contiguous input is copied once
                torch = import_torch()
                view = torch.frombuffer(dst, dtype=src.dtype, count=src.numel(), offset=offset)
                view.view(src.shape).copy_(src)


class Verbatim(Encoded):
    """A body already serialized (received from a relay, or read with StoreReader.body), to be
    written as it is: checked once with every check of decode (check_body), never decoded and
    encoded again, so whatever
    decode accepts can be stored (even what encode would refuse to make, such as nesting
    deeper than MAX_DEPTH). Holds `body` until written.

    Raises:
        CorruptObject: `body` is not one decode accepts.
    """

    __slots__ = ("_body",)

    def __init__(self, body: memoryview) -> None:
        check_body(body)  # every count, offset, dtype and shape; nothing copied or imported
        _, n_buffers, struct_bytes = BODY_HEADER.unpack_from(body, 0)
        struct_end = BODY_HEADER.size + BUFFER_ENTRY.size * n_buffers + struct_bytes
        super().__init__(bytes(body[:struct_end]), [], len(body))
        self._body = body

    def whole(self) -> memoryview:
        return self._body

    def write_into(self, dst: memoryview) -> None:
        if len(dst) < self.nbytes:
            raise ValueError(f"destination holds {len(dst)} bytes, the object needs {self.nbytes}")
        dst[:self.nbytes] = self._body


def encode(obj: Any, *, root: str = "obj", blanks: bool = False) -> Encoded:
    """Check and size `obj`; return an Encoded to write with `write_into`.

    Raises:
        NotSerializable: an unsupported type, an int outside 64 bits, nesting deeper than
            MAX_DEPTH or a str that is not valid Unicode, with its path (obj['pixel_values'][2]);
            a Blank unless `blanks` (StoreWriter.reserve).
    """
    enc: _Encoder | None = None
    if type(obj) in _LEAVES:  # a bare scalar, str or bytes: nothing to walk
        tree = obj
    else:
        enc = _Encoder(root, blanks)
        tree = enc.walk(obj, (), 0)
    try:
        structure = _PACK(tree)
    except UnicodeEncodeError:
        where = _format_path(root, _leaf_path(obj, (), _not_utf8) or ())
        raise NotSerializable(f"cannot serialize the str at {where}: it is not valid Unicode (a "
                              "lone surrogate); encode it with errors='surrogatepass' and send "
                              "bytes", where) from None
    except OverflowError:
        where = _format_path(root, _leaf_path(obj, (), _wider_than_64_bits) or ())
        raise NotSerializable(f"cannot serialize the int at {where}: it does not fit in 64 bits; "
                              "send it as a str or a numpy array", where) from None
    if enc is None or not enc.sources:  # no arrays (queue messages): header and structure only
        return Encoded(BODY_HEADER.pack(BODY_MAGIC, 0, len(structure)) + structure, [],
                       BODY_HEADER.size + len(structure))
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


def _not_utf8(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _wider_than_64_bits(value: Any) -> bool:
    return isinstance(value, int) and not _INT_MIN <= value < _INT_LIMIT


def _leaf_path(obj: Any, path: tuple[Any, ...], bad: Callable[[Any], bool]
               ) -> tuple[Any, ...] | None:
    """Where in `obj` a value (or dict key) for which `bad` is true is (the slow path of an
    encode error); walks what walk() produced a tree for, so no depth check is needed."""
    if bad(obj):
        return path
    if isinstance(obj, dict):
        for k, v in obj.items():
            found = path if bad(k) else _leaf_path(v, path + (k,), bad)
            if found is not None:
                return found
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found = _leaf_path(v, path + (i,), bad)
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

"""mm_hash: a content hash of multimodal media plus the context that shaped its tensors.

The hash input is a self-delimiting byte stream: every value is written as a one-byte type tag,
then a u64 length or item count, then its content, so two different structures can never
produce the same stream. Dict keys are ordered by their own encoding, so key order does not
matter. Arrays and tensors contribute dtype, shape and raw bytes; PIL images mode, size and
pixels. Nothing is pickled; an unsupported type raises TypeError naming it and its path.

blake3 (the `blake3` package) is the default; `algorithm="sha256"` uses hashlib (for FIPS
environments). The result is deterministic across processes, runs and machines of the same
byte order.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from typing import Any, Protocol

import numpy as np

from ..errors import InvalidArgument, NotSerializable

__all__ = ["mm_hash", "ALGORITHMS"]

ALGORITHMS = ("blake3", "sha256")
DOMAIN = b"shmstore.mm_hash.v1"  # changes if the stream format ever changes
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
MAX_DEPTH = 100


class _Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...

    def hexdigest(self) -> str: ...


def _new_hasher(algorithm: str) -> _Hasher:
    if algorithm == "blake3":
        try:
            from blake3 import blake3
        except ImportError as exc:
            raise ModuleNotFoundError(
                "mm_hash uses blake3 by default: pip install blake3, or pass algorithm='sha256'"
            ) from exc
        return blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise InvalidArgument(f"unknown hash algorithm {algorithm!r}; choose one of {ALGORITHMS}",
                          "algorithm", algorithm)


def mm_hash(item: Any, *, algorithm: str = "blake3", **context: Any) -> str:
    """Return the hex digest of `item` (the media) and `context` (model id, processor kwargs).

    Args:
        item: raw encoded bytes, a numpy array, a torch tensor, a PIL image, or nested
            dict / list / tuple of those and of None, bool, int, float, str.
        algorithm: "blake3" (default) or "sha256".
        **context: anything else that changes the preprocessed result, e.g. model="llava-1.5",
            size=336. Order does not matter.

    Raises:
        TypeError: a value of another type (named, with its path).
    """
    hasher = _new_hasher(algorithm)
    hasher.update(DOMAIN)
    writer = _StreamWriter(hasher)
    writer.value(item, "item", 0)
    writer.value(context, "context", 0)
    return hasher.hexdigest()


class _StreamWriter:
    def __init__(self, hasher: _Hasher) -> None:
        self.h = hasher

    def head(self, tag: bytes, n: int) -> None:
        self.h.update(tag + _U64.pack(n))

    def value(self, obj: Any, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise NotSerializable(f"mm_hash: {path} is nested deeper than {MAX_DEPTH} levels (or "
                                  "cyclic): flatten it, or hash its parts and hash the digests",
                                  path)
        if obj is None:
            self.head(b"N", 0)
        elif obj is True or obj is False:
            self.head(b"T" if obj else b"F", 0)
        elif isinstance(obj, int):
            text = str(int(obj)).encode()
            self.head(b"i", len(text))
            self.h.update(text)
        elif isinstance(obj, float):
            self.head(b"f", 8)
            self.h.update(_F64.pack(obj))
        elif isinstance(obj, str):
            data = obj.encode("utf-8", "surrogatepass")
            self.head(b"s", len(data))
            self.h.update(data)
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            view = memoryview(obj).cast("B") if isinstance(obj, memoryview) else obj
            self.head(b"b", len(view))
            self.h.update(view)
        elif isinstance(obj, np.ndarray):
            self.array(obj, path)
        elif isinstance(obj, np.generic):
            self.array(np.asarray(obj), path)
        elif isinstance(obj, (list, tuple)):
            self.head(b"l" if isinstance(obj, list) else b"t", len(obj))
            for i, v in enumerate(obj):
                self.value(v, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            entries = []
            for k, v in obj.items():
                key_stream = _KeyCollector()
                _StreamWriter(key_stream).value(k, f"{path} key {k!r}", depth + 1)
                entries.append((bytes(key_stream.data), k, v))
            entries.sort(key=lambda e: e[0])
            self.head(b"d", len(entries))
            for encoded_key, k, v in entries:
                self.h.update(encoded_key)
                self.value(v, f"{path}[{k!r}]", depth + 1)
        elif _is_tensor(obj):
            self.tensor(obj, path)
        elif _is_pil_image(obj):
            self.image(obj)
        else:
            raise NotSerializable(
                f"mm_hash cannot hash {type(obj).__module__}.{type(obj).__qualname__} at {path}: "
                "use bytes, numpy arrays, torch tensors, PIL images, or dict/list/tuple of "
                "None, bool, int, float and str", path)

    def array(self, arr: np.ndarray, path: str) -> None:
        if arr.dtype.kind not in "biufc":
            raise NotSerializable(f"mm_hash cannot hash arrays of dtype {arr.dtype} at {path}: "
                                  "convert it to a numeric dtype or hash its bytes", path)
        self.shaped(b"a", arr.dtype.str, arr.shape)
        self.h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))

    def tensor(self, t: Any, path: str) -> None:
        import torch

        if t.device.type != "cpu" or t.layout is not torch.strided:
            raise NotSerializable(f"mm_hash hashes dense CPU tensors only; {path} is {t.device} "
                                  f"{t.layout}: move it with .cpu() / .to_dense()", path)
        t = t.detach().contiguous()
        self.shaped(b"x", str(t.dtype), tuple(t.shape))
        self.h.update(t.reshape(-1).view(torch.uint8).numpy())

    def image(self, im: Any) -> None:
        pixels = im.tobytes()
        self.shaped(b"p", im.mode, tuple(im.size))
        self.h.update(_U64.pack(len(pixels)))
        self.h.update(pixels)

    def shaped(self, tag: bytes, dtype: str, shape: tuple[int, ...]) -> None:
        text = dtype.encode()
        self.head(tag, len(text))
        self.h.update(text)
        self.h.update(_U64.pack(len(shape)))
        for d in shape:
            self.h.update(_U64.pack(d))


class _KeyCollector:
    """A hasher stand-in that keeps the stream, so dict entries can be sorted by key encoding."""

    def __init__(self) -> None:
        self.data = bytearray()

    def update(self, data: Any, /) -> None:
        self.data += data

    def hexdigest(self) -> str:  # pragma: no cover - never asked
        return self.data.hex()


def _is_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_pil_image(obj: object) -> bool:
    image_module = sys.modules.get("PIL.Image")
    return image_module is not None and isinstance(obj, image_module.Image)

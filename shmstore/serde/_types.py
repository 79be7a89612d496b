"""The serializer's wire constants and dtype tables (serde/_codec.py draws the layout)."""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np

__all__ = ["BODY_HEADER", "BUFFER_ENTRY", "BODY_MAGIC", "BUFFER_ALIGN_BYTES", "MAX_DEPTH",
           "MAX_NDIM", "MAX_DIM", "EXT_NDARRAY", "EXT_TENSOR", "EXT_TUPLE", "EXT_SCALAR",
           "EXT_HANDLE", "NUMERIC_KINDS", "NUMPY_DTYPES", "TORCH_DTYPE_NAMES", "TORCH_ITEMSIZES",
           "import_torch", "torch_dtype_table", "is_tensor"]

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

NUMERIC_KINDS = frozenset("biufc")
# Every numeric and bool numpy dtype in both byte orders, as dtype.str: the only dtypes decode
# will build (an arbitrary dtype string could name object or structured dtypes).
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {}
for _code in ("?", "b", "B", "h", "H", "i", "I", "l", "L", "q", "Q", "e", "f", "d", "g",
              "F", "D", "G"):
    for _dt in (np.dtype(_code), np.dtype(_code).newbyteorder()):
        NUMPY_DTYPES[_dt.str] = _dt

# Every torch dtype shmstore carries, with its item size: known without importing torch, so a
# body can be checked (a relay storing what it received) where torch is slow to import or absent.
TORCH_ITEMSIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2,
    "uint32": 4, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}
TORCH_DTYPE_NAMES = tuple(TORCH_ITEMSIZES)
_torch_dtypes: dict[str, tuple[Any, int]] | None = None  # name -> (dtype, itemsize), lazily


def import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ModuleNotFoundError(
            "this object holds torch tensors but torch is not installed here: "
            "pip install 'shmstore[torch]'"
        ) from exc
    return torch


def torch_dtype_table() -> dict[str, tuple[Any, int]]:
    global _torch_dtypes
    if _torch_dtypes is None:
        torch = import_torch()
        _torch_dtypes = {
            n: (getattr(torch, n), getattr(torch, n).itemsize)
            for n in TORCH_DTYPE_NAMES if hasattr(torch, n)
        }
    return _torch_dtypes


def is_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)

"""Structure-aware fuzzing of decode: hostile bodies that pass every framing check.

A byte-level fuzzer rarely gets past the magic, the buffer table and the CRC, so it never reaches
deep nesting, extension metadata or shapes. Here hypothesis builds the msgpack structure itself
(nested arrays, maps and tuple marks up to past msgpack's own depth limit, every extension code
with well-formed, nearly well-formed and random metadata, huge and negative numbers), frames it
with a valid header, a buffer table that is valid or not, and the right CRC, and decodes it with
and without copies. The only allowed outcomes are a value or CorruptObject; returned arrays lie
inside the body. Deep cases also run in a thread with a small stack, where C recursion would crash.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmstore.serde._codec import (
    BODY_HEADER,
    BODY_MAGIC,
    BUFFER_ALIGN_BYTES,
    BUFFER_ENTRY,
    EXT_HANDLE,
    EXT_NDARRAY,
    EXT_SCALAR,
    EXT_TENSOR,
    EXT_TUPLE,
)
from shmstore.serde._decode import _Decoder, _unpack
from tests._names import CorruptObject, Handle, decode, encode

torch = pytest.importorskip("torch")

EXAMPLES = 400
SMALL_STACK_BYTES = 512 << 10

ints = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.sampled_from(
    [0, 1, -1, 2**31, 2**32 - 1, 2**62, 2**63 - 1, -(2**63), 2**64 - 1]))
leaves = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True),
                   st.text(max_size=8), st.binary(max_size=8))
dtype_strs = st.one_of(st.sampled_from(["<f4", "|u1", ">i8", "<c16", "|b1", "<f2", "|O", "<U4",
                                        "V8", "", "<f4\x00"]), st.text(max_size=6), ints)
torch_names = st.one_of(st.sampled_from(["float32", "bfloat16", "uint8", "bool", "float8_e5m2",
                                         "quint8", "Tensor", "", "float32 "]),
                        st.text(max_size=8), ints)
dims = st.one_of(st.integers(0, 6), st.sampled_from([2**31, 2**40, 2**62, 2**63 - 1, -1]),
                 st.floats(), st.text(max_size=2), st.none())
shapes = st.one_of(st.lists(dims, max_size=5), st.lists(st.integers(0, 2), min_size=60,
                                                        max_size=70), leaves)
indexes = st.one_of(st.integers(-2, 5), ints, st.text(max_size=2), st.none())


def _meta(items: st.SearchStrategy[list[Any]]) -> st.SearchStrategy[bytes]:
    """Extension metadata: packed well-formed lists, or anything."""
    return st.one_of(items.map(msgpack.packb), st.binary(max_size=24))


exts = st.one_of(
    st.builds(lambda d: msgpack.ExtType(EXT_NDARRAY, d),
              _meta(st.tuples(dtype_strs, shapes, indexes).map(list))),
    st.builds(lambda d: msgpack.ExtType(EXT_TENSOR, d),
              _meta(st.tuples(torch_names, shapes, indexes).map(list))),
    st.builds(lambda d: msgpack.ExtType(EXT_SCALAR, d),
              _meta(st.tuples(dtype_strs, st.binary(max_size=17)).map(list))),
    st.builds(lambda d: msgpack.ExtType(EXT_TUPLE, d), st.sampled_from([b"", b"\x00"])),
    st.builds(lambda d: msgpack.ExtType(EXT_HANDLE, d),
              st.one_of(st.binary(min_size=40, max_size=40), st.binary(max_size=48))),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12)),
)
TUPLE = msgpack.ExtType(EXT_TUPLE, b"")


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(lambda xs: [TUPLE, *xs]),  # a tuple
        st.lists(children, min_size=1, max_size=4).map(lambda xs: [*xs, TUPLE]),  # a misplaced mark
        st.dictionaries(st.one_of(leaves, exts), children, max_size=3),
    )


trees = st.recursive(st.one_of(leaves, exts), _containers, max_leaves=24)


class Packed(bytes):
    """msgpack bytes built by hand (the packer itself refuses deep nesting)."""


@st.composite
def nested(draw: st.DrawFn) -> Packed:
    """A chain of lists, tuples and maps, up to past msgpack's 1024-level limit."""
    depth = draw(st.sampled_from([50, 99, 100, 101, 500, 1023, 1024, 1025, 3000]))
    kinds = draw(st.lists(st.sampled_from("lmt"), min_size=1, max_size=3))
    inner = msgpack.packb(draw(st.one_of(leaves, exts)))
    prefix = bytearray()
    for level in range(depth):  # outermost first
        kind = kinds[level % len(kinds)]
        if kind == "l":
            prefix += b"\x91"  # array of 1
        elif kind == "m":
            prefix += b"\x81" + msgpack.packb(level)  # map of 1: {level: ...}
        else:
            prefix += b"\x92" + msgpack.packb(TUPLE)  # array of 2: [tuple mark, ...]
    return Packed(bytes(prefix) + inner)


@st.composite
def bodies(draw: st.DrawFn, structures: st.SearchStrategy[Any]) -> bytes:
    """A body whose header, table and CRC pass, with `structures` as its msgpack."""
    drawn = draw(structures)
    structure = drawn if isinstance(drawn, Packed) else msgpack.packb(drawn)
    n_buffers = draw(st.integers(0, 4))
    table_end = BODY_HEADER.size + BUFFER_ENTRY.size * n_buffers
    end = table_end + len(structure)
    table = []
    for _ in range(n_buffers):
        size = draw(st.sampled_from([0, 1, 4, 8, 24, 64, 96]))
        if draw(st.integers(0, 5)):  # mostly a valid placement: aligned, after the one before
            offset = (end + BUFFER_ALIGN_BYTES - 1) & ~(BUFFER_ALIGN_BYTES - 1)
        else:
            offset = draw(st.one_of(st.integers(0, end + 256), ints.filter(lambda x: x >= 0)))
            size = draw(st.one_of(st.just(size), ints.filter(lambda x: x >= 0)))
        table.append((offset % (1 << 64), size % (1 << 64)))
        end = max(end, min(offset + size, 1 << 16))
    raw = bytearray(max(end, table_end + len(structure)) + draw(st.integers(0, 64)))
    BODY_HEADER.pack_into(raw, 0, BODY_MAGIC, n_buffers, len(structure))
    for i, (offset, size) in enumerate(table):
        BUFFER_ENTRY.pack_into(raw, BODY_HEADER.size + BUFFER_ENTRY.size * i, offset, size)
    raw[table_end:table_end + len(structure)] = structure
    return bytes(raw)


def _crc(body: bytes) -> int:
    _, n_buffers, struct_bytes = BODY_HEADER.unpack_from(body, 0)
    return zlib.crc32(body[:BODY_HEADER.size + BUFFER_ENTRY.size * n_buffers + struct_bytes])


def _arrays_inside(value: Any, base: memoryview, seen: int = 0) -> None:
    """Every zero-copy array in `value` points into `base`'s bytes."""
    stack = [value]
    low = np.frombuffer(base, np.uint8).ctypes.data if len(base) else 0
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, np.ndarray) and item.size:
            start = item.ctypes.data
            assert low <= start and start + item.nbytes <= low + len(base)


def _outcome(call: Any) -> tuple[Any, str | None]:
    try:
        return call(), None
    except CorruptObject as exc:
        return None, str(exc)


def _decode_both_ways(body: bytes) -> None:
    crc = _crc(body)
    for copy in (True, False):
        view = memoryview(body)
        try:
            value = decode(view, copy=copy, expected_crc=crc)
        except CorruptObject:
            continue
        if not copy:
            _arrays_inside(value, view)
    # With no CRC to check, a body of msgpack's own types takes decode()'s short path: it must
    # give what the full path gives, the same value or the same error.
    short = _outcome(lambda: decode(memoryview(body)))
    full = _outcome(lambda: _unpack(memoryview(body), _Decoder(memoryview(body), True), None, b""))
    assert short[1] == full[1] and _same(short[0], full[0]), (short, full)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies(trees))
def test_any_structure_decodes_or_raises_corrupt_object(body: bytes) -> None:
    _decode_both_ways(body)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(bodies(nested()))
def test_deep_nesting_never_recurses_in_c(body: bytes) -> None:
    failures: list[BaseException] = []

    def run() -> None:
        try:
            _decode_both_ways(body)
        except BaseException as exc:  # reported in the main thread
            failures.append(exc)

    old = threading.stack_size(SMALL_STACK_BYTES)
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join(60)
    finally:
        threading.stack_size(old)
    assert not t.is_alive() and not failures, failures


values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
              st.floats(allow_nan=False), st.text(max_size=6), st.binary(max_size=6),
              st.builds(lambda n, d: (np.arange(n) % 3).astype(d), st.integers(0, 9),
                        st.sampled_from(["<f4", "|u1", ">i8", "|b1", "<c8"])),
              st.builds(lambda n: torch.arange(n, dtype=torch.bfloat16), st.integers(0, 5)),
              st.builds(Handle, st.integers(0, 2**40).map(lambda a: a * 64),
                        st.integers(1, 2**62), st.binary(min_size=16, max_size=16),
                        st.integers(1, 2**62))),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.lists(children, max_size=3).map(tuple),
                               st.dictionaries(st.text(max_size=4), children, max_size=3)),
    max_leaves=16)


def _same(a: Any, b: Any) -> bool:
    """Equal in type and value all the way down (a loop, not recursion: values nest ~1000 deep)."""
    pairs = [(a, b)]
    while pairs:
        a, b = pairs.pop()
        if type(a) is not type(b):
            return False
        if isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return False
            pairs.extend(zip(a, b))
        elif isinstance(a, dict):
            if len(a) != len(b):
                return False
            pairs.extend(zip(a.keys(), b.keys()))
            pairs.extend(zip(a.values(), b.values()))
        elif isinstance(a, np.ndarray):
            if not (a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()):
                return False
        elif isinstance(a, torch.Tensor):
            if not (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
                return False
        elif isinstance(a, float) and a != a:
            if b == b:  # NaN only matches NaN
                return False
        elif not a == b:
            return False
    return True


@settings(max_examples=EXAMPLES, deadline=None)
@given(values, st.data())
def test_one_changed_structure_byte_is_caught_or_harmless(value: Any, data: st.DataObject) -> None:
    """Real bodies with one structure byte changed and the CRC recomputed (what a writer bug or a
    forged body looks like): a value or CorruptObject, never another exception."""
    enc = encode(value)
    raw = bytearray(enc.nbytes)
    enc.write_into(memoryview(raw))
    assert _same(decode(memoryview(bytes(raw))), value)
    _, n_buffers, struct_bytes = BODY_HEADER.unpack_from(raw, 0)
    struct_end = BODY_HEADER.size + BUFFER_ENTRY.size * n_buffers + struct_bytes
    at = data.draw(st.integers(4, struct_end - 1))
    raw[at] = data.draw(st.integers(0, 255).filter(lambda b: b != raw[at]))
    _decode_both_ways(bytes(raw))

"""Serializer: every supported type round-trips exactly; bad input and corrupt bytes fail cleanly."""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmstore.serde._codec import (
    BODY_HEADER,
    BUFFER_ENTRY,
    EXT_NDARRAY,
    EXT_TENSOR,
    Verbatim,
)
from shmstore.serde._decode import check_body
from shmstore.serde._types import NUMPY_DTYPES as ALL_NUMPY_DTYPES
from shmstore.serde._types import TORCH_DTYPE_NAMES, TORCH_ITEMSIZES
from tests._names import CorruptObject, Handle, NotSerializable, decode, dumps, encode, loads

NUMPY_DTYPES = sorted({dt.name for dt in ALL_NUMPY_DTYPES.values()})
TORCH_DTYPES = [getattr(torch, n) for n in TORCH_DTYPE_NAMES if hasattr(torch, n)]


@pytest.fixture(autouse=True)
def no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing on the decode path may unpickle."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)


def same(a: object, b: object) -> bool:
    """Exact equality, including type, dtype and shape, down the structure."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()  # type: ignore[attr-defined]
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()  # type: ignore[attr-defined]
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return (a.dtype == b.dtype and a.shape == b.shape
                and bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy())
                == bytes(b.contiguous().reshape(-1).view(torch.uint8).numpy()))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)  # type: ignore[attr-defined,index]
    return a == b or (a != a and b != b)  # NaN


def roundtrip(obj: object) -> None:
    data = dumps(obj)
    assert same(obj, loads(data, copy=True))
    buf = bytearray(data)  # writable, like shared memory
    assert same(obj, decode(memoryview(buf), copy=False))


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3, 4), (1, 0, 5)])
def test_numpy_dtypes_and_shapes(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    arr = (rng.integers(0, 100, size=shape)).astype(dtype)
    roundtrip(arr)
    roundtrip(arr.astype(arr.dtype.newbyteorder()))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3)])
def test_torch_dtypes_and_shapes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    roundtrip(t.to(dtype))


def test_non_contiguous_inputs_are_copied_once_and_come_back_contiguous() -> None:
    arr = np.arange(60, dtype=np.int32).reshape(6, 10)[::2, 1::3]
    t = torch.arange(60).reshape(6, 10).t()[1:, ::2]
    out = loads(dumps({"a": arr, "t": t}))
    assert np.array_equal(out["a"], arr) and out["a"].flags.c_contiguous
    assert torch.equal(out["t"], t) and out["t"].is_contiguous()


def test_nested_structures_keep_tuples_and_scalars() -> None:
    obj = {
        "pixel_values": np.ones((2, 3, 4, 4), np.float32),
        "image_grid_thw": (1, 16, 16),
        "meta": [None, True, False, -(2**63), 2**64 - 1, 1.5, "é", b"\x00\xff", ()],
        "nested": ((1, (2, [3, {"k": (4,)}])),),
        7: "int key", b"raw": "bytes key", None: 0.0,
        "np_scalar": np.float16(2.5), "handle": Handle(64, 3, b"k" * 16, 99),
    }
    roundtrip(obj)


def test_zero_copy_views_point_into_the_buffer_and_are_read_only() -> None:
    buf = bytearray(dumps({"a": np.arange(16, dtype=np.uint8), "t": torch.arange(4)}))
    out = decode(memoryview(buf), copy=False)
    assert not out["a"].flags.writeable
    start = bytes(buf).index(bytes(range(16)))
    buf[start] = 99
    assert out["a"][0] == 99  # a view, not a copy
    copy = decode(memoryview(buf), copy=True)
    buf[start] = 0
    assert copy["a"][0] == 99


def test_arrays_are_cache_line_aligned_in_the_body() -> None:
    enc = encode([np.ones(3, np.uint8), np.ones(5, np.float64), torch.ones(7)])
    for offset, _ in enc._buffers:
        assert offset % 64 == 0


def test_body_header_offsets() -> None:
    raw = BODY_HEADER.pack(b"SSB1", 2, 3) + BUFFER_ENTRY.pack(64, 5)
    assert raw[0:4] == b"SSB1"
    assert struct.unpack_from("<I", raw, 4) == (2,) and struct.unpack_from("<Q", raw, 8) == (3,)
    assert struct.unpack_from("<QQ", raw, 16) == (64, 5)


class Custom:
    pass


@pytest.mark.parametrize(
    ("obj", "path", "what"),
    [
        ({"kwargs": {"pixel_values": [1, 2, Custom()]}}, r"obj\['kwargs'\]\['pixel_values'\]\[2\]",
         "Custom"),
        ([{1, 2}], r"obj\[0\]", "set"),
        ({"a": np.array(["x"])}, r"obj\['a'\]", "dtype <U1"),
        ({"o": np.array([object()])}, r"obj\['o'\]", "dtype object"),
        ({(1, 2): 3}, r"obj\[\(1, 2\)\]", "dict keys"),
        ({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, r"obj\['q'\]", "qint8"),
        ({"s": torch.ones(2).to_sparse()}, r"obj\['s'\]", "sparse"),
        ({"m": np.ma.array([1, 2], mask=[True, False])}, r"obj\['m'\]", "MaskedArray"),
    ],
)
def test_unsupported_types_name_the_type_and_path(obj: object, path: str, what: str) -> None:
    with pytest.raises(TypeError, match=path) as info:
        encode(obj)
    assert what in str(info.value)


def test_int_out_of_range_and_too_deep() -> None:
    with pytest.raises(NotSerializable, match=r"obj\['big'\]") as info:
        encode({"big": 2**64})
    assert info.value.path == "obj['big']"
    with pytest.raises(NotSerializable, match=r"obj\[0\]"):
        encode([-(2**63) - 1])

    class Wide(int):
        pass

    with pytest.raises(NotSerializable, match=r"int at obj\['a'\]\[1\]\[0\]: .* 64 bits"):
        encode({"a": [1, (Wide(2**70),)], "b": 2})
    with pytest.raises(NotSerializable, match=r"int at obj\['k'\]: .* 64 bits"):
        encode({"k": {2**64: "key"}})
    # a bare value takes encode's short path (no walk): the same errors, at the root
    with pytest.raises(NotSerializable, match=r"int at msg: .* 64 bits") as info:
        encode(2**64, root="msg")
    assert info.value.path == "msg"
    with pytest.raises(NotSerializable, match=r"str at obj: it is not valid Unicode"):
        encode("\udc80")
    for value in (None, False, -(2**63), 2**64 - 1, -0.0, "", b"\x00"):
        assert loads(dumps(value)) == value and type(loads(dumps(value))) is type(value)
    deep: list[object] = []
    node = deep
    for _ in range(200):
        node.append([])
        node = node[0]  # type: ignore[assignment]
    with pytest.raises(NotSerializable, match="nested deeper"):
        encode(deep)
    cyclic: list[object] = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="cyclic"):
        encode(cyclic)


def test_write_into_a_short_destination_is_refused() -> None:
    enc = encode(np.ones(100))
    with pytest.raises(ValueError, match="needs"):
        enc.write_into(memoryview(bytearray(enc.nbytes - 1)))


def _body(structure: bytes, buffers: list[tuple[int, int]], total: int) -> bytearray:
    table = b"".join(BUFFER_ENTRY.pack(o, n) for o, n in buffers)
    head = BODY_HEADER.pack(b"SSB1", len(buffers), len(structure)) + table + structure
    return bytearray(head.ljust(total, b"\0"))


@pytest.mark.parametrize(
    "body",
    [
        bytearray(b""),
        bytearray(b"SSB1"),
        bytearray(b"XXXX" + bytes(12)),
        BODY_HEADER.pack(b"SSB1", 0, 10**12),  # structure beyond the body
        BODY_HEADER.pack(b"SSB1", 2**32 - 1, 0),  # table beyond the body
        _body(msgpack.packb(msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["|O", [1], 0]))), [(64, 8)], 128),
        _body(msgpack.packb(msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["<f4", [3], 0]))), [(64, 8)], 128),
        _body(msgpack.packb(msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["<f4", [-2], 0]))), [(64, 8)], 128),
        _body(msgpack.packb(msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["<f4", [2], 5]))), [(64, 8)], 128),
        _body(msgpack.packb(msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["<f4", [2], 0]))), [(65, 8)], 128),
        _body(msgpack.packb(msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["<f4", [2], 0]))),
              [(64, 10**9)], 128),
        _body(msgpack.packb(msgpack.ExtType(EXT_TENSOR, msgpack.packb(["qint8", [2], 0]))), [(64, 2)], 128),
        _body(msgpack.packb(msgpack.ExtType(99, b"")), [], 64),
        _body(msgpack.packb(msgpack.ExtType(3, b"\x01")), [], 64),  # tuple of a non-list
        _body(msgpack.packb(msgpack.ExtType(5, b"short")), [], 64),
        _body(b"\xc1", [], 64),  # never-used msgpack byte
        _body(b"\x81\x90\x01", [], 64),  # map with a list key
        _body(b"\xdd\xff\xff\xff\xff", [], 64),  # array claiming 4 billion items
    ],
)
def test_corrupt_bodies_raise_corrupt_object(body: bytes) -> None:
    with pytest.raises(CorruptObject):
        decode(memoryview(bytearray(body)), copy=True)
    with pytest.raises(CorruptObject):
        decode(memoryview(bytearray(body)), copy=False)
    with pytest.raises(CorruptObject):
        check_body(memoryview(bytearray(body)))


SAMPLE = dumps({"pixel_values": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
                "sizes": (336, 336), "t": torch.ones(3, dtype=torch.bfloat16), "s": "text"})


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_bodies_raise_corrupt_object_or_decode(data: st.DataObject) -> None:
    body = bytearray(SAMPLE)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    for candidate in (body, body[:cut]):
        refused = []
        for copy in (True, False):
            try:
                decode(memoryview(bytearray(candidate)), copy=copy)
            except CorruptObject:
                refused.append(True)
            else:
                refused.append(False)
        try:
            check_body(memoryview(bytearray(candidate)))
        except CorruptObject:
            refused.append(True)
        else:
            refused.append(False)
        assert len(set(refused)) == 1, refused  # check_body accepts exactly what decode does


class _HandlerSaid(Exception):
    pass


def test_an_exception_of_a_signal_handler_during_a_short_decode_goes_on_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a damaged or extended structure sends the short path to the full one: what a
    signal handler raises while msgpack unpacks (a Python hook runs it) reaches the caller,
    and is not swallowed by a second, quiet try."""
    import shmstore.serde._decode as decoding

    real, calls = msgpack.unpackb, [0]

    def interrupted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == 1:
            raise _HandlerSaid
        return real(*args, **kwargs)

    monkeypatch.setattr(decoding.msgpack, "unpackb", interrupted)
    with pytest.raises(_HandlerSaid):
        decode(memoryview(dumps({"n": 1})))
    assert calls[0] == 1
    assert decode(memoryview(dumps({"n": 1}))) == {"n": 1}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash(raw: bytes) -> None:
    try:
        decode(memoryview(bytearray(raw)), copy=False)
    except CorruptObject:
        pass


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(json_like)
def test_plain_structures_roundtrip(obj: object) -> None:
    roundtrip(obj)


def test_the_static_torch_item_sizes_are_torchs() -> None:
    assert {n: getattr(torch, n).itemsize for n in TORCH_DTYPE_NAMES if hasattr(torch, n)} == {
        n: s for n, s in TORCH_ITEMSIZES.items() if hasattr(torch, n)}
    assert len(TORCH_DTYPES) >= 17  # the dtypes every torch 2.x has


def test_checking_a_body_with_tensors_imports_nothing() -> None:
    """A relay stores received bodies as Verbatim; torch's first import takes seconds on a busy
    machine, and a relay that stalls that long misses its heartbeats and is dropped."""
    body = dumps({"t": torch.arange(6, dtype=torch.bfloat16).view(2, 3),
                  "a": np.ones(4, dtype=np.float32)})
    script = ("import sys; from shmstore.serde._codec import Verbatim; "
              "v = Verbatim(memoryview(sys.stdin.buffer.read())); "
              "print(v.nbytes, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], input=body, capture_output=True,
                          timeout=60, check=True)
    assert done.stdout.decode().split() == [str(len(body)), "False"]


def test_verbatim_writes_a_checked_body_byte_for_byte_and_refuses_a_damaged_one() -> None:
    value = {"pixel_values": np.arange(1000, dtype=np.float32).reshape(10, 100),
             "t": torch.ones(3, dtype=torch.bfloat16), "meta": (1, "x")}
    body = dumps(value)
    verbatim = Verbatim(memoryview(body))
    assert verbatim.nbytes == len(body)
    assert verbatim.structure_crc == encode(value).structure_crc  # the store's header CRC
    out = bytearray(len(body) + 8)
    verbatim.write_into(memoryview(out))
    assert bytes(out[:len(body)]) == body
    got = loads(bytes(out[:len(body)]))
    np.testing.assert_array_equal(got["pixel_values"], value["pixel_values"])
    assert got["meta"] == (1, "x") and torch.equal(got["t"], value["t"])
    with pytest.raises(ValueError, match="destination"):
        verbatim.write_into(memoryview(bytearray(len(body) - 1)))
    damaged = bytearray(body)
    struct.pack_into("<Q", damaged, BODY_HEADER.size, 1 << 40)  # buffer 0's offset
    with pytest.raises(CorruptObject):
        Verbatim(memoryview(damaged))
    with pytest.raises(CorruptObject):
        Verbatim(memoryview(body[:10]))

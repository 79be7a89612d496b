"""mm_hash: deterministic across processes, framed, order-independent for dict keys, typed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from shmstore.cache._hashing import mm_hash
from shmstore.errors import InvalidArgument, NotSerializable

SAMPLES = [
    None, True, False, 0, -1, 2**80, 1.5, float("inf"), "", "text", b"", b"\x89PNG...", bytearray(b"ab"),
    memoryview(b"ab"), np.zeros((2, 3), np.float32), np.arange(4, dtype=">i4"), np.float16(1),
    torch.ones(2, 2, dtype=torch.bfloat16), Image.new("RGB", (4, 3), (1, 2, 3)),
    Image.new("L", (3, 4), 7), [1, [2, 3]], (1, 2), {"a": [1], "b": {"c": b"x"}},
]


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_every_supported_type_hashes_deterministically(algorithm: str) -> None:
    digests = [mm_hash(x, algorithm=algorithm) for x in SAMPLES]
    assert digests == [mm_hash(x, algorithm=algorithm) for x in SAMPLES]
    assert all(len(d) == 64 for d in digests)


def test_distinct_values_give_distinct_hashes() -> None:
    distinct = [s for s in SAMPLES if not isinstance(s, (bytearray, memoryview))]
    assert len({mm_hash(x) for x in distinct}) == len(distinct)


@pytest.mark.parametrize(("a", "b"), [
    (["ab", "c"], ["a", "bc"]),                      # framing: no concatenation collisions
    ([b"ab", b"c"], [b"a", b"bc"]),
    ([[1], 2], [1, [2]]),                            # structure is part of the stream
    ((1, 2), [1, 2]),                                # tuple vs list
    ("1", 1), (b"1", "1"), (1, 1.0), (0, False), (None, b""),
    (np.zeros(4, np.float32), np.zeros(4, np.int32)),  # dtype
    (np.zeros((2, 2)), np.zeros(4)),                 # shape
    (Image.new("RGB", (2, 3)), Image.new("RGB", (3, 2))),
    (Image.new("RGB", (2, 2)), Image.new("RGBA", (2, 2))),
    ({"a": 1, "b": 2}, {"a": 1, "b": 3}),
    ({"ab": "c"}, {"a": "bc"}),
])
def test_different_structures_never_collide(a: object, b: object) -> None:
    assert mm_hash(a) != mm_hash(b)


def test_dict_key_order_does_not_matter_and_context_counts() -> None:
    assert mm_hash({"a": 1, "b": 2}) == mm_hash({"b": 2, "a": 1})
    image = b"raw jpeg bytes"
    assert mm_hash(image, model="m", size=336) == mm_hash(image, size=336, model="m")
    assert mm_hash(image, model="m", size=336) != mm_hash(image, model="m", size=448)
    assert mm_hash(image) != mm_hash(image, model="m")
    assert mm_hash(image, algorithm="sha256") != mm_hash(image)


def test_non_contiguous_arrays_hash_like_their_contents() -> None:
    arr = np.arange(20, dtype=np.int32).reshape(4, 5)
    assert mm_hash(arr[:, ::2]) == mm_hash(np.ascontiguousarray(arr[:, ::2]))
    t = torch.arange(6).reshape(2, 3)
    assert mm_hash(t.t()) == mm_hash(t.t().contiguous())


def test_same_hash_in_another_process() -> None:
    code = ("import numpy as np; from shmstore.cache._hashing import mm_hash; "
            "print(mm_hash({'px': np.arange(6, dtype=np.float32)}, model='llava', size=336))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, check=True)
    here = mm_hash({"px": np.arange(6, dtype=np.float32)}, size=336, model="llava")
    assert out.stdout.strip() == here


class Opaque:
    pass


@pytest.mark.parametrize(("item", "where"), [
    (Opaque(), "item"), ({"k": [1, Opaque()]}, r"item\['k'\]\[1\]"), ({1, 2}, "item"),
    (np.array(["s"]), "item"), (np.array([object()]), "item"),
])
def test_unknown_types_raise_type_error_with_path(item: object, where: str) -> None:
    with pytest.raises(NotSerializable, match=where):
        mm_hash(item)


def test_unknown_algorithm_and_bad_context() -> None:
    with pytest.raises(InvalidArgument, match="sha256"):
        mm_hash(b"x", algorithm="md5")
    with pytest.raises(NotSerializable, match=r"context\['processor'\]"):
        mm_hash(b"x", processor=Opaque())
    cyclic: list[object] = []
    cyclic.append(cyclic)
    with pytest.raises(NotSerializable, match="nested deeper"):
        mm_hash(cyclic)

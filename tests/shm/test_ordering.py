"""The libatomic ordering path (used on ARM) works; forced here on x86 in a child process."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from tests.conftest import new_name

CODE = """
import numpy as np, shmstore, shmstore.shm._ordering as o
assert o.ORDERING == "libatomic", o.ORDERING
w = shmstore.ObjectStore.create({name!r}, capacity_bytes=1 << 20, n_readers=1)
r = shmstore.ObjectStore.attach({name!r}, reader=0)
try:
    for i in range(50):
        h = w.put(f"k{{i}}", np.full(50_000, i, np.int32), timeout=1)
        assert int(r.get(h)[0]) == i
    s = w.stats()
    assert s.reader_lag == (0,) and s.evictions > 0, s
    print("ok")
finally:
    r.close(); w.close()
"""


@pytest.mark.skipif(ctypes.util.find_library("atomic") is None, reason="libatomic not installed")
def test_libatomic_path_round_trips() -> None:
    env = {**os.environ, "SHMSTORE_ORDERING": "libatomic"}
    out = subprocess.run([sys.executable, "-c", CODE.format(name=new_name("atomic"))],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_values_wrap_at_64_bits_instead_of_raising() -> None:
    """A counter loaded from damaged memory may be 2**64 - 1; the next store must not raise."""
    import mmap

    from shmstore.shm._ordering import OrderedWords

    mapping = mmap.mmap(-1, 64)
    words = OrderedWords(mapping)
    try:
        words.store_release(0, 2**64 - 1 + 1)
        assert words.load_acquire(0) == 0
        assert words.exchange(8, 2**64 + 5) == 0 and words.load_acquire(8) == 5
        assert words.compare_exchange(8, 5, 2**65 + 7) and words.load_acquire(8) == 7
    finally:
        words.release()
        mapping.close()

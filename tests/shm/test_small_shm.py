"""A real 64 MiB /dev/shm (a private mount namespace): full memory fails at create, never SIGBUS."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

CODE = r"""
import os, numpy as np
from tests._names import ObjectStore, ShmSpaceError
a = ObjectStore.create("small-a", capacity_bytes=40 << 20, n_readers=0)
try:
    ObjectStore.create("small-b", capacity_bytes=40 << 20, n_readers=0)
except ShmSpaceError as exc:
    print("refused:", exc)
    assert exc.free_bytes is not None and exc.free_bytes < (40 << 20)
assert not os.path.exists("/dev/shm/small-b"), "a failed create must leave nothing"
# fill what is left of /dev/shm with a plain file: a store that reserved its pages keeps working
with open("/dev/shm/filler", "wb", buffering=0) as f:
    try:
        while True:
            f.write(b"\0" * (1 << 20))
    except OSError:
        pass
data = np.ones(1 << 20, dtype=np.uint8)
for i in range(200):  # wraps the 40 MiB ring five times, touching every page
    a.put(f"k{i}", data)
print("puts after /dev/shm filled:", a.stats().puts)
a.close()
os.unlink("/dev/shm/filler")
"""


def _can_make_private_shm() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not _can_make_private_shm(),
                    reason="no private mount namespace here; the mocked tests in test_segment cover it")
def test_full_dev_shm_is_a_clear_error_and_reserved_stores_keep_working() -> None:
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable, CODE],
        capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: cannot reserve 40.0 MiB" in out.stdout
    assert "--shm-size" in out.stdout
    assert "puts after /dev/shm filled: 200" in out.stdout

"""Entry points for reader processes started with the spawn method (importable by children)."""

from __future__ import annotations

import hashlib
from typing import Any

from shmstore import Handle, ObjectStore


def checksum(obj: Any) -> str:
    """blake2b over the bytes of every array/tensor in a {'data': ..., 'extra': [...]} object."""
    h = hashlib.blake2b(digest_size=16)
    for arr in [obj["data"], *obj["extra"]]:
        if not hasattr(arr, "tobytes"):  # a torch tensor
            arr = arr.contiguous().view(-1).view(__import__("torch").uint8).numpy()
        h.update(memoryview(arr).cast("B") if arr.nbytes else b"")
    h.update(repr(obj["meta"]).encode())
    return h.hexdigest()


def reader_main(name: str, reader: int, inbox: Any, results: Any) -> None:
    """Read every handle from `inbox` (alternating view and get), verify, report counts."""
    store = ObjectStore.attach(name, reader=reader)
    n_read = mismatches = views = 0
    try:
        while True:
            msg = inbox.get(timeout=60)
            if msg is None:
                break
            packed, expected = msg
            handle = Handle.unpack(packed)
            if n_read % 2:
                with store.view(handle) as obj:
                    ok = checksum(obj) == expected
                views += 1
            else:
                ok = checksum(store.get(handle)) == expected
            n_read += 1
            mismatches += not ok
        results.put((reader, n_read, mismatches, views, None))
    except Exception as exc:  # report, so the test fails with the reason instead of a timeout
        results.put((reader, n_read, mismatches, views, f"{type(exc).__name__}: {exc}"))
    finally:
        store.close()

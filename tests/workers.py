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


def queue_reader_main(name: str, reader: int, results: Any, timeout: float) -> None:
    """Attach to a queue, signal readiness, then report what one blocked get() ended with."""
    import time

    from shmstore import BroadcastQueue

    q = BroadcastQueue.attach(name, reader=reader)
    try:
        results.put(("attached", reader))
        t0 = time.monotonic()
        try:
            msg = q.get(timeout=timeout)
            results.put(("message", msg, time.monotonic() - t0))
        except Exception as exc:
            results.put((type(exc).__name__, str(exc), time.monotonic() - t0))
    finally:
        q.close()


def channel_reader_main(name: str, reader: int, results: Any, stop_after: int | None,
                        hold_s: float = 0.0) -> None:
    """Receive every value from a channel until Closed (or `stop_after` values); verify them.

    After stopping early it stays attached, not reading, for `hold_s` seconds.
    """
    from shmstore import Channel, Closed

    ch = Channel.attach(name, reader=reader)
    received = mismatches = out_of_order = 0
    try:
        while stop_after is None or received < stop_after:
            try:
                if received % 2:
                    with ch.recv_view(timeout=60) as value:
                        ok = _value_ok(value)
                        index = value["i"]
                else:
                    value = ch.recv(timeout=60)
                    ok = _value_ok(value)
                    index = value["i"]
            except Closed:
                break
            out_of_order += index != received
            mismatches += not ok
            received += 1
        results.put((reader, received, mismatches, out_of_order, None))
        if stop_after is not None:
            __import__("time").sleep(hold_s)
    except Exception as exc:
        results.put((reader, received, mismatches, out_of_order, f"{type(exc).__name__}: {exc}"))
    finally:
        ch.close()


def _value_ok(value: dict[str, Any]) -> bool:
    data = value["data"]
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest() == value["sum"]

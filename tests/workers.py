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


def reader_main(name: str, reader: int, inbox: Any, results: Any, use_torch: bool) -> None:
    """Say ("ready", reader) once attached (torch imported if asked), then read every handle
    from `inbox` (alternating view and get), verify, report counts."""
    store = ObjectStore.attach(name, reader=reader)
    if use_torch:
        import torch  # noqa: F401  (seconds on a loaded machine: before "ready", not inside a put)
    results.put(("ready", reader))
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


def sum_checksum(arr: Any) -> int:
    """Cheap full-coverage checksum: the wrapped sum of the array's 8-byte words."""
    import numpy as np

    words = np.ascontiguousarray(arr).reshape(-1).view(np.uint64)
    return int(words.sum(dtype=np.uint64))


def crash_reader_main(store_name: str, queue_name: str, reader: int, results: Any,
                      hang_in_view: bool) -> None:
    """Read (handle, checksum) messages from a queue and verify each object in the store.

    With hang_in_view, stop inside the first view and wait to be killed.
    """
    import time

    from shmstore import BroadcastQueue, Closed, ObjectStore, StaleHandle

    store = ObjectStore.attach(store_name, reader=reader)
    queue = BroadcastQueue.attach(queue_name, reader=reader)
    results.put(("attached", reader))
    received = mismatches = stale = 0
    try:
        while True:
            try:
                msg = queue.get(timeout=60)
            except Closed:
                break
            packed, expected = msg
            try:
                with store.view(Handle.unpack(packed)) as obj:
                    if hang_in_view:
                        results.put(("in view", reader))
                        time.sleep(600)
                    mismatches += sum_checksum(obj) != expected
            except StaleHandle:
                stale += 1
            received += 1
        results.put(("done", reader, received, mismatches, stale, None))
    except Exception as exc:
        results.put(("done", reader, received, mismatches, stale, f"{type(exc).__name__}: {exc}"))
    finally:
        queue.close()
        store.close()


def channel_writer_main(name: str, big: bool, results: Any) -> None:
    """Send numbered, checksummed values through a channel until killed."""
    import numpy as np

    from shmstore import Channel

    base = np.random.default_rng(1).integers(0, 2**63, 1 << 20, dtype=np.uint64)  # 8 MiB
    with Channel.create(name, n_readers=2, capacity_bytes=64 << 20, inline_threshold=4096) as ch:
        results.put(("writer ready", 0))
        ch.wait_for_readers(timeout=60)
        i = 0
        while True:
            n = (4 << 20) // 8 + i % 1000 if big else 100 + i % 300
            data = base[i % 1000:i % 1000 + n]
            ch.send({"i": i, "data": data, "sum": sum_checksum(data)}, timeout=60)
            i += 1


def channel_survivor_main(name: str, reader: int, results: Any) -> None:
    """Receive until WriterGone; report what was received and when the death was noticed."""
    import time

    from shmstore import Channel, WriterGone

    ch = Channel.attach(name, reader=reader)
    results.put(("attached", reader))
    received = mismatches = out_of_order = 0
    try:
        while True:
            try:
                value = ch.recv(timeout=60)
            except WriterGone:
                results.put(("gone", reader, time.monotonic(), received, mismatches,
                             out_of_order, None))
                return
            out_of_order += value["i"] != received
            mismatches += sum_checksum(value["data"]) != value["sum"]
            received += 1
    except Exception as exc:
        results.put(("gone", reader, time.monotonic(), received, mismatches, out_of_order,
                     f"{type(exc).__name__}: {exc}"))
    finally:
        ch.close()


def fake_relay_main(name: str, sent: Any) -> None:
    """A node's relay as its readers see it: creates the node channel, waits for one reader,
    sends one inline value and one stored object (key b"id-1"), then sleeps until killed."""
    import time

    from shmstore import Channel

    channel = Channel.create(name, n_readers=1, capacity_bytes=4 << 20, inline_threshold=1024)
    channel.wait_for_readers(60)
    channel.send({"inline": 1})
    channel.publish(channel.store.hand_out_new(b"id-1", {"x": 1}))
    sent.set()
    time.sleep(600)


def churn() -> int:
    """What a photo's processing does to memory (a 9 MB decode, a copy, a 12 MB float tensor
    and one more, all freed at the end): the minor page faults it took."""
    import numpy as np

    def faults() -> int:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    before = faults()
    decoded = np.ones(9 << 20, np.uint8)
    copied = decoded.copy()
    tensor = copied[:3 << 20].astype(np.float32)
    scaled = tensor * 2
    del decoded, copied, tensor, scaled
    return faults() - before


def toy_processor(gate_dir: str = "") -> Any:
    """A miss pool Processor factory (serving/_pool.py) for tests: a job is a dict with the
    item's "bytes" and what to do with them. Each job writes `<gate_dir>/started-<n>` when it
    begins and, with "hold", waits until `<gate_dir>/open` exists, so a test sees jobs run at
    once without timing anything."""
    import os
    import signal
    import time

    import numpy as np

    def process(job: dict[str, Any]) -> Any:
        if gate_dir:
            with open(os.path.join(gate_dir, f"started-{job.get('n', 0)}-{os.getpid()}"), "w"):
                pass
            while job.get("hold") and not os.path.exists(os.path.join(gate_dir, "open")):
                time.sleep(0.01)
        if job.get("helper") and os.fork() == 0:  # a helper holding the worker's pipes
            with open(os.path.join(gate_dir, f"helper-{os.getpid()}"), "w"):
                pass
            time.sleep(120)
            os._exit(0)
        if job.get("die"):
            os.kill(os.getpid(), signal.SIGKILL)
        if job.get("when_lent"):  # "die" or "wait" once the pool lends the item's chunk
            _when_lent(job["when_lent"], gate_dir)
        if job.get("begin_twice"):  # a worker that asks for a second chunk before its done
            _begin_twice()
        if job.get("fail"):
            raise ValueError(f"cannot decode image: {job['fail']}")
        if job.get("decline"):
            return None
        if "photo" in job:  # by shared memory (serving/_photos.py)
            from shmstore.serving._photos import read_photo

            job = {**job, "bytes": read_photo(job["photo"])}
        data = np.frombuffer(job["bytes"], dtype=np.uint8)
        if job.get("churn"):
            return {"data": data, "pid": os.getpid(), "faults": churn()}
        return {"data": data ^ 0xFF, "pid": os.getpid()}
    return process


def _when_lent(what: str, gate_dir: str) -> None:
    """In a pool worker: once the dispatcher's answer lends a chunk (the next answer read),
    die there ("die": SIGKILL, the chunk lent and half written) or write `<gate_dir>/lent`
    and wait for `<gate_dir>/go` ("wait")."""
    import os
    import signal
    import time

    import msgpack

    real = msgpack.unpackb

    def unpackb(data: bytes, **kw: Any) -> Any:
        answer = real(data, **kw)
        if isinstance(answer, list) and answer[:1] == ["lent"]:
            msgpack.unpackb = real
            if what == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            with open(os.path.join(gate_dir, "lent"), "w"):
                pass
            while not os.path.exists(os.path.join(gate_dir, "go")):
                time.sleep(0.01)
        return answer
    msgpack.unpackb = unpackb


def _begin_twice() -> None:
    """In a pool worker: this job's item asks for a chunk (lent), then asks again (a begin out
    of turn) and goes on with the pool's answer to that."""
    from shmstore.serving import _crew

    real = _crew._write

    def twice(say: Any, conn: Any, buf: Any, key: str, value: Any) -> Any:
        _crew._write = real
        say(_crew.Says.BEGIN, key, 80 * 1024, 0)  # a chunk as large as the item
        conn.recv_bytes()  # lent
        return real(say, conn, buf, key, value)
    _crew._write = twice


def broken_processor() -> Any:
    """A Processor factory that cannot build (a model the pool cannot load)."""
    raise RuntimeError("no such model: tiny-missing")

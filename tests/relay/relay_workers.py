"""Process bodies for test_relay_mp.py (spawned, so importable at module level)."""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import numpy as np

from shmstore import Channel, Closed, Timeout, WriterGone


def item(key: int) -> np.ndarray:
    """The array stored under key `key`: its size and bytes follow from the key (at least
    150 kB: more than the wire check's slack, so one object sent twice would show)."""
    nbytes = 150_000 + (key * 7919) % 250_000
    return np.random.default_rng(key).integers(0, 255, nbytes, dtype=np.uint8)


def value_for(i: int, key: int | None) -> Any:
    """Message i: a small inline dict (key None) or the stored item of `key`."""
    if key is None:
        return {"i": i, "note": "inline", "pad": bytes(i % 500)}
    arr = item(key)
    return {"k": key, "pv": arr, "crc": zlib.crc32(arr.tobytes())}


def reader(channel: str, index: int, out_path: str, idle_s: float) -> None:
    """Receive until the channel ends; write what came and how it ended as JSON lines."""
    received: list[Any] = []
    bad = 0
    how = "timeout"
    with Channel.attach(channel, index) as r:
        with open(out_path + ".ready", "w"):
            pass
        while True:
            try:
                value = r.recv(timeout=idle_s)
            except Closed:
                how = "closed"
                break
            except WriterGone:
                how = "gone"
                break
            except Timeout:
                break
            if "k" in value:
                ok = (zlib.crc32(value["pv"].tobytes()) == value["crc"]
                      and np.array_equal(value["pv"], item(value["k"])))
                bad += not ok
                received.append(["k", value["k"]])
            else:
                ok = value == {"i": value["i"], "note": "inline", "pad": bytes(value["i"] % 500)}
                bad += not ok
                received.append(["i", value["i"]])
    # written whole under another name, then renamed: the test polls for out_path and must
    # never read a half-written file
    with open(out_path + ".part", "w") as f:
        json.dump({"received": received, "bad": bad, "how": how}, f)
    os.replace(out_path + ".part", out_path)


def writer(channel: str, n_readers: int, plan: list[Any], ready_path: str,
           start_path: str, done_path: str) -> None:
    """Create the channel, wait for its readers and a go file, send `plan`, then hang until
    killed (the test kills it: a writer that dies)."""
    import os
    import time

    w = Channel.create(channel, n_readers=n_readers, capacity_bytes=64 << 20)
    w.wait_for_readers(60)
    with open(ready_path, "w"):
        pass
    while not os.path.exists(start_path):
        time.sleep(0.01)
    for i, key in enumerate(plan):
        w.send(value_for(i, key), key=None if key is None else f"img-{key}", timeout=30)
    with open(done_path, "w"):
        pass
    time.sleep(600)

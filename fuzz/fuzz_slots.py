"""Coverage-guided fuzzing (atheris) of the queue's hand-off: damaged slots read by both paths.

    python fuzz/fuzz_slots.py -runs=5000            # or leave -runs out to run until stopped

Each input is a message's bytes and a list of (offset, value) writes into its slot after it was
published. The same damage is read by the compiled Slots (_native/_atomic.c) and by its Python
twin (queue/_slots.py); both must give the same outcome (the message, CorruptObject or Timeout, the same
message text), and the next message must get through alike. Any other exception, a crash
(the sanitizer build of scripts/check-native.sh catches memory errors) or a difference is a
finding. Without the compiled part there is nothing to compare: it says so and exits 0.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from typing import Any

import atheris

with atheris.instrument_imports():
    from shmstore import BroadcastQueue, CorruptObject, Timeout
    from shmstore.queue import _slots

SLOT_BYTES = 256
N_SLOTS = 4
logging.getLogger("shmstore").setLevel(logging.ERROR)  # a skipped damaged message, each run


def outcome(path: str, payload: bytes, writes: list[tuple[int, int]]) -> tuple[str, ...]:
    _slots.SLOTS = _slots.COMPILED if path == "compiled" else _slots.PythonSlots
    name = f"shmstore-fuzz-{os.getpid()}-{secrets.token_hex(4)}"
    with BroadcastQueue.create(name, n_readers=1, slot_bytes=SLOT_BYTES, n_slots=N_SLOTS,
                               spin_s=0) as q:
        r = BroadcastQueue.attach(name, 0, spin_s=0)
        try:
            q.put(payload, tag=7)
            start, stride = q.slot(1), q.slot(2) - q.slot(1)
            for offset, value in writes:
                q._buf[start + offset % stride] = value
            try:
                first: tuple[str, ...] = ("message", repr(r.get_message(timeout=0)))
            except (CorruptObject, Timeout) as exc:
                first = (type(exc).__name__, str(exc).replace(name, "Q"))
            q.put("next", timeout=1)
            try:
                second = repr(r.get(timeout=0))
            except (CorruptObject, Timeout) as exc:
                second = type(exc).__name__
            return (*first, second, str(r.skipped))
        finally:
            r.close()


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    payload = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, SLOT_BYTES - 64))
    writes = [(fdp.ConsumeIntInRange(0, 1 << 16), fdp.ConsumeIntInRange(0, 255))
              for _ in range(fdp.ConsumeIntInRange(0, 4))]
    compiled = outcome("compiled", payload, writes)
    python = outcome("python", payload, writes)
    if compiled != python:
        raise AssertionError(f"the paths differ on {payload!r} with {writes}: "
                             f"compiled {compiled}, python {python}")


def main(argv: list[str]) -> None:
    if _slots.COMPILED is None:
        print("fuzz_slots: the compiled hand-off is not built here: nothing to compare")
        return
    saved: Any = _slots.SLOTS
    try:
        atheris.Setup(argv, test_one_input)
        atheris.Fuzz()
    finally:
        _slots.SLOTS = saved


if __name__ == "__main__":
    main(sys.argv)

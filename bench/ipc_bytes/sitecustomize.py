"""Counts the bytes vLLM serializes for inter-process messages, in every process of a server
that bench_serve.py starts with this folder first on PYTHONPATH and SHMSTORE_BENCH_BYTES_DIR
set (no effect otherwise); with SHMSTORE_BENCH_STALL_DIR set too (bench_serve.py --stalls),
also says where each process stood when it stalled (below).

Every message between vLLM's API servers and its engine cores (requests, hits included, with
their multimodal items by value under the processor-only fallback; outputs back) goes through
vllm.v1.serial_utils.MsgpackEncoder: this wraps its encode and encode_into and writes the
process's running total of the buffers they return to DIR/PID every 0.2 s. The engine core's
broadcast to tensor-parallel workers (shared memory, pickled) is not counted.
"""

from __future__ import annotations

import os
import sys
import threading
import time

_DIR = os.environ.get("SHMSTORE_BENCH_BYTES_DIR")


def _size(buffers: object) -> int:
    total = 0
    for b in buffers:  # type: ignore[attr-defined]
        total += memoryview(b).nbytes
    return total


_COUNTED = [0]


def _patch(encoder: type) -> None:
    encode, encode_into = encoder.encode, encoder.encode_into  # type: ignore[attr-defined]

    def counting_encode(self, obj):  # type: ignore[no-untyped-def]
        out = encode(self, obj)
        _COUNTED[0] += _size(out)
        return out

    def counting_encode_into(self, obj, buf):  # type: ignore[no-untyped-def]
        out = encode_into(self, obj, buf)
        _COUNTED[0] += _size(out)
        return out

    encoder.encode = counting_encode  # type: ignore[attr-defined]
    encoder.encode_into = counting_encode_into  # type: ignore[attr-defined]


def _watch(directory: str) -> None:
    written = -1
    while True:
        module = sys.modules.get("vllm.v1.serial_utils")
        if module is not None and not getattr(module, "_bytes_counted", False):
            module._bytes_counted = True  # type: ignore[attr-defined]
            _patch(module.MsgpackEncoder)
        if _COUNTED[0] != written:
            written = _COUNTED[0]
            with open(os.path.join(directory, str(os.getpid())), "w") as f:
                f.write(str(written))
        time.sleep(0.2)


# A stall: a process whose Python threads cannot run for STALL_S (one holds the GIL in a
# long call, or the process is not scheduled). A thread re-arms faulthandler's timer every
# STALL_TICK_S; where it cannot, the timer's own thread (C, no GIL needed) writes every
# thread's stack into DIR/PID, and the thread, once it runs again, writes the wall time and
# how late it was.
_STALL_DIR = os.environ.get("SHMSTORE_BENCH_STALL_DIR")
STALL_S = 0.3
STALL_TICK_S = 0.05


def _watch_stalls(directory: str) -> None:
    import faulthandler

    with open(os.path.join(directory, str(os.getpid())), "a") as out:
        out.write(f"process {os.getpid()} {' '.join(sys.argv)[:200]}\n")
        out.flush()
        while True:
            faulthandler.dump_traceback_later(STALL_S, file=out)
            before = time.monotonic()
            time.sleep(STALL_TICK_S)
            late = time.monotonic() - before - STALL_TICK_S
            if late > STALL_S:
                out.write(f"stalled: {late:.3f} s late, woke at {time.time():.3f}\n")
                out.flush()


def _start() -> None:
    if _DIR:
        threading.Thread(target=_watch, args=(_DIR,), daemon=True, name="ipc-bytes").start()
    if _STALL_DIR:
        threading.Thread(target=_watch_stalls, args=(_STALL_DIR,), daemon=True,
                         name="stall-watch").start()


def _start_in_child() -> None:
    _COUNTED[0] = 0  # its own count, in its own file (the encoder stays patched)
    _start()


_start()
os.register_at_fork(after_in_child=_start_in_child)

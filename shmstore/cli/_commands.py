"""Command line: `shmstore demo | hitrate TRACE | ls | rm NAME | gc` (also `python -m shmstore`)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import stat
import sys
import time
from dataclasses import dataclass

from .._proc import pid_alive
from ..shm._segment import KIND_NAMES, MAGIC, MAKING_MAGIC, SEGMENT_HEADER, SHM_DIR
from ._units import format_age, format_size


@dataclass(frozen=True)
class SegmentInfo:
    """What `shmstore ls` shows of one segment in /dev/shm."""

    name: str
    kind: int
    n_readers: int
    size_bytes: int
    writer_pid: int
    writer_alive: bool
    created_ns: int
    complete: bool  # False: its writer was still creating it (or died doing so)

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, f"kind {self.kind}")


def list_segments(shm_dir: str = SHM_DIR) -> list[SegmentInfo]:
    """Every shmstore segment in `shm_dir` this user can read, by name (half-made ones too)."""
    found = []
    for entry in sorted(os.listdir(shm_dir)):
        path = os.path.join(shm_dir, entry)
        try:  # only regular files, opened so that nothing blocks (anyone may put a FIFO here)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            header = os.pread(fd, SEGMENT_HEADER.size, 0)
            size = st.st_size
        except OSError:
            continue
        finally:
            os.close(fd)
        if len(header) < SEGMENT_HEADER.size or header[:8] not in (MAGIC, MAKING_MAGIC):
            continue
        magic, _, kind, n_readers, _, _, _, pid, _, created_ns = SEGMENT_HEADER.unpack(header)
        found.append(SegmentInfo(entry, kind, n_readers, size, pid, pid_alive(pid), created_ns,
                                 magic == MAGIC))
    return found


def _native_path() -> str:
    """Which path this install runs: the compiled module, or its Python twins (and why)."""
    from .._native import ATOMIC, ORDERING

    if ORDERING == "compiled":
        return "compiled words and queue hand-off"
    why = "module not built" if ATOMIC is None else "SHMSTORE_ORDERING"
    return f"Python twins, {ORDERING} ordering: {why}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shmstore", description=(
        "Shared-memory object store and caches for multimodal LLM serving."))
    parser.add_argument("--version", action="version",
                        version=f"shmstore {importlib.metadata.version('shmstore')} "
                                f"({_native_path()})")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a frontend and N workers sharing image tensors")
    from ._demo import add_arguments

    add_arguments(demo)
    hitrate = commands.add_parser("hitrate", help="hit ratios of every cache kind on your trace")
    from ._hitrate import add_arguments as hitrate_arguments

    hitrate_arguments(hitrate)
    relay = commands.add_parser("relay", help="readers on other nodes: serve, connect, keygen")
    from ._relay import add_arguments as relay_arguments

    relay_arguments(relay)
    commands.add_parser("serve", add_help=False, help="vLLM's `vllm serve` on its CUDA or CPU "
                        "build, with shmstore's plugin (every argument goes to vLLM)")
    tiny = commands.add_parser("tiny-model", help="build a tiny LLaVA with random weights to try "
                               "the vLLM plugin without a download (needs vLLM installed)")
    tiny.add_argument("dir", help="where to write it (made if missing)")
    tiny.add_argument("--kind", choices=["llava", "llava_next"], default="llava",
                      help="LLaVA-1.5 (default) or LLaVA-NeXT (anyres tiles)")
    tiny.add_argument("--image-size", type=int, default=56,
                      help="pixels, a multiple of 14 (336 is LLaVA-1.5's)")
    commands.add_parser("ls", help="list shmstore segments in /dev/shm with owner, size and age")
    rm = commands.add_parser("rm", help="remove a segment whose writer is dead (never a live one)")
    rm.add_argument("names", nargs="+", metavar="NAME")
    commands.add_parser("gc", help="remove every segment whose writer is dead")
    return parser


def cmd_ls() -> int:
    rows = [("NAME", "KIND", "READERS", "SIZE", "WRITER", "STATE", "AGE")]
    now = time.time_ns()
    for info in list_segments():
        rows.append((info.name, info.kind_name, str(info.n_readers), format_size(info.size_bytes),
                     str(info.writer_pid), ("alive" if info.writer_alive else "dead")
                     + ("" if info.complete else ", half-made"),
                     format_age((now - info.created_ns) / 1e9)))
    if len(rows) == 1:
        print("no shmstore segments in /dev/shm")
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


def remove(name: str) -> tuple[bool, str]:
    """Remove one dead segment (and a queue's semaphores, only once its segment went); return
    whether it was removed and what happened. A segment a new writer took over meanwhile is
    left alone (the check and the unlink hold a lock on the dead writer's file)."""
    from ..errors import SegmentExists
    from ..queue._broadcast import remove_semaphores
    from ..shm._segment import KIND_QUEUE, Segment

    info = next((i for i in list_segments() if i.name == name), None)
    if info is None:
        return False, f"{name}: no shmstore segment of that name"
    if info.writer_alive:
        return False, f"{name}: its writer (pid {info.writer_pid}) is alive; stop it instead"
    try:
        removed = Segment.remove_stale(name)
    except SegmentExists as exc:
        return False, f"{name}: not removed: {exc}"
    if not removed:
        return False, f"{name}: not removed: it was removed or taken over meanwhile"
    extra = ""
    if info.kind == KIND_QUEUE:
        extra = f" and {remove_semaphores(name, info.n_readers)} semaphores"
    return True, f"{name}: removed ({format_size(info.size_bytes)}{extra})"


def cmd_rm(names: list[str]) -> int:
    status = 0
    for name in names:
        removed, message = remove(name)
        print(message)
        status |= 0 if removed else 1
    return status


def cmd_gc() -> int:
    dead = [i.name for i in list_segments() if not i.writer_alive]
    removed = 0
    for name in dead:
        done, message = remove(name)
        removed += done
        print(message)
    print(f"{removed} dead segment(s) removed")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # vLLM parses the rest, --help included
        from ._serve import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from ._demo import main as demo_main

        return demo_main(args)
    if args.command == "hitrate":
        from ._hitrate import main as hitrate_main

        return hitrate_main(args)
    if args.command == "relay":
        from ._relay import main as relay_main

        return relay_main(args)
    if args.command == "tiny-model":
        from ._tiny import main as tiny_main

        return tiny_main(args)
    if args.command == "ls":
        return cmd_ls()
    if args.command == "rm":
        return cmd_rm(args.names)
    return cmd_gc()


if __name__ == "__main__":
    sys.exit(main())

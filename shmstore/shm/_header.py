"""The header every shmstore segment starts with, and what can be learnt of a name without
mapping it.

Layout of every shmstore segment (all integers little-endian)::

    offset  size  field
    0       8     magic            b"SHMSTORE", written last; b"SHMSTMK~" while being made
                                   (the rest of the header, writer_pid included, is valid then)
    8       4     layout_version   u32, LAYOUT_VERSION
    12      4     kind             u32, KIND_* of the layer that made it
    16      4     n_readers        u32
    20      4     data_offset      u32, start of the data area, a multiple of ALIGN_BYTES
    24      8     capacity_bytes   u64, size of the data area
    32      8     total_bytes      u64, data_offset + capacity_bytes
    40      8     writer_pid       i64
    48      8     epoch            u64, random, new for every create
    56      8     created_ns       u64, time.time_ns() at create
    64      ...   meta area        owned by the layer of `kind` (reader tables, ...)
    data_offset   data area        capacity_bytes, owned by the layer of `kind`
"""

from __future__ import annotations

import os
import re
import stat
import struct

import posix_ipc

from ..errors import InvalidName

__all__ = ["SEGMENT_HEADER", "MAGIC", "MAKING_MAGIC", "LAYOUT_VERSION", "ALIGN_BYTES", "KIND_RING",
           "KIND_QUEUE", "KIND_NAMES", "SHM_DIR", "MAX_CAPACITY_BYTES", "MAX_NAME_CHARS", "align_up",
           "shm_free_bytes", "validate_name", "posix_name", "regular_file", "peek_header", "peek_epoch",
           "being_made", "peek_writer_pid"]

MAGIC = b"SHMSTORE"
MAKING_MAGIC = b"SHMSTMK~"  # header written before the space is reserved: a crash is visible
LAYOUT_VERSION = 3  # bump on any change to a binary layout of any layer
ALIGN_BYTES = 64  # one cache line: headers, chunks and tensor buffers start on one
KIND_RING = 1  # ShmRingBuffer / ObjectStore
KIND_QUEUE = 2  # BroadcastQueue
KIND_NAMES = {KIND_RING: "object store (ring buffer)", KIND_QUEUE: "broadcast queue"}
SHM_DIR = "/dev/shm"  # where Linux shows POSIX shared memory, for messages and free-space checks
MAX_CAPACITY_BYTES = 1 << 46  # 64 TiB: far above any machine's shared memory, far below u64
MAX_NAME_CHARS = 200  # NAME_MAX is 255; leave room for prefixes a caller may add
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")

SEGMENT_HEADER = struct.Struct("<8sIIIIQQqQQ")
assert SEGMENT_HEADER.size == 64  # the layout above; tests check each offset too


def align_up(nbytes: int, align: int = ALIGN_BYTES) -> int:
    """Round `nbytes` up to a multiple of `align` (a power of two)."""
    return (nbytes + align - 1) & ~(align - 1)


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm, or None where it cannot be read."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def validate_name(name: str) -> str:
    """Check a segment name and return it; raise InvalidName saying what is allowed."""
    if not isinstance(name, str):
        raise InvalidName(f"segment name must be a str, not {type(name).__name__}")
    if not (1 <= len(name) <= MAX_NAME_CHARS) or _NAME_RE.fullmatch(name) is None:
        raise InvalidName(
            f"invalid segment name {name!r}: use 1-{MAX_NAME_CHARS} characters from "
            "A-Z a-z 0-9 _ . - , not starting with '.' or '-' (no '/': the name lives in /dev/shm)"
        )
    return name


def posix_name(name: str) -> str:
    return "/" + name


def regular_file(name: str) -> bool:
    """Whether SHM_DIR/name is a regular file (what shm_open makes), without opening it: a FIFO
    opened for reading would block, and one opened read-write cannot be read at an offset."""
    try:
        return stat.S_ISREG(os.lstat(os.path.join(SHM_DIR, name)).st_mode)
    except OSError:
        return False


def peek_header(name: str) -> tuple[int, int, int] | None:
    """(kind, n_readers, writer pid) of a shmstore segment, complete or being made, read without
    mapping it; None if there is none of that name (or only something that is not one)."""
    fields = _peek_fields(name)
    return None if fields is None else (int(fields[2]), int(fields[3]), int(fields[7]))


def peek_epoch(name: str) -> int | None:
    """The epoch of the shmstore segment `name` now (new for every create), None if there is
    none: how a reader learns that its writer made the store anew."""
    fields = _peek_fields(name)
    return None if fields is None else int(fields[8])


def _header_bytes(name: str) -> bytes | None:
    """The first SEGMENT_HEADER.size bytes (or fewer) of shared memory `name`, read without
    mapping it; None if there is no regular file of that name."""
    if not regular_file(name):
        return None
    try:
        shm = posix_ipc.SharedMemory(posix_name(name))
    except posix_ipc.Error:
        return None
    try:
        return os.pread(shm.fd, SEGMENT_HEADER.size, 0)
    except OSError:  # replaced by something that is not a file meanwhile
        return None
    finally:
        shm.close_fd()


def _peek_fields(name: str) -> tuple[int | bytes, ...] | None:
    header = _header_bytes(name)
    if header is None or len(header) < SEGMENT_HEADER.size or \
            header[:8] not in (MAGIC, MAKING_MAGIC):
        return None
    return tuple(SEGMENT_HEADER.unpack(header))


def being_made(name: str) -> bool:
    """Whether `name` is a shmstore segment its writer is still creating (its header not
    written whole yet): an attach should come back in a moment, not give up."""
    header = _header_bytes(name)
    return header is not None and (len(header) < SEGMENT_HEADER.size
                                   or header[:8] == MAKING_MAGIC)


def peek_writer_pid(name: str) -> int | None:
    header = peek_header(name)
    return None if header is None else header[2]

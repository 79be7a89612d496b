"""Segment: one POSIX shared-memory object, its fixed header, its mapping.

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

Who may call what: the creating process (the owner) may `unlink()`; any process may `attach()`
and `close()`. Memoryviews from `buf` stay valid until `close()`.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import time
import warnings
from types import TracebackType

import posix_ipc

from ._closeable import Closeable
from ._ordering import OrderedWords
from ._proc import int_arg, pid_alive
from .errors import (
    BadMagic,
    InvalidArgument,
    InvalidName,
    SegmentClosed,
    SegmentExists,
    SegmentNotFound,
    SegmentPermissionError,
    SegmentTooSmall,
    ShmSpaceError,
    VersionMismatch,
    WrongSegmentKind,
)

__all__ = [
    "Segment",
    "SEGMENT_HEADER",
    "ALIGN_BYTES",
    "LAYOUT_VERSION",
    "MAGIC",
    "KIND_RING",
    "KIND_QUEUE",
    "MAKING_MAGIC",
    "align_up",
    "shm_free_bytes",
    "peek_header",
]

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

log = logging.getLogger("shmstore")

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


def _posix_name(name: str) -> str:
    return "/" + name


class Segment(Closeable):
    """One POSIX shared-memory object mapped into this process.

    Create with `Segment.create` (the owner, who alone unlinks) or `Segment.attach` (any process
    of the same user; nothing needs pickling, the name is enough).
    """

    # Class-level defaults so a half-built Segment can still be closed.
    name = ""
    kind = 0
    n_readers = 0
    data_offset = 0
    capacity_bytes = 0
    total_bytes = 0
    writer_pid = 0
    epoch = 0
    created_ns = 0
    is_owner = False
    _mmap: mmap.mmap | None = None
    _buf: memoryview | None = None
    _words: OrderedWords | None = None
    _unlinked = False

    def __init__(self) -> None:
        raise TypeError("use Segment.create(...) or Segment.attach(...)")

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        name: str | None,
        *,
        kind: int,
        capacity_bytes: int,
        meta_bytes: int = 0,
        n_readers: int = 0,
        mode: int = 0o600,
        prefault: bool = True,
    ) -> Segment:
        """Create and map a new segment exclusively; the caller becomes its owner.

        Args:
            name: the name in /dev/shm; None picks `shmstore-<random>`.
            kind: KIND_* of the calling layer, checked on attach.
            capacity_bytes: size of the data area.
            meta_bytes: size of the layer's own header area after the segment header.
            mode: permission bits (0o600: only this user may attach).
            prefault: map with MAP_POPULATE so later writes take no page faults.

        A shmstore segment left behind by a writer that died (its pid is gone) is taken over:
        unlinked and created anew. A live writer's name is never taken.

        Raises:
            SegmentExists: the name is taken (the message says by whom and what to do).
            ShmSpaceError: /dev/shm cannot hold `capacity_bytes` more.
        """
        if name is None:
            name = f"shmstore-{secrets.token_hex(6)}"
        validate_name(name)
        capacity_bytes = int_arg(capacity_bytes, "capacity_bytes", 0, MAX_CAPACITY_BYTES)
        meta_bytes = int_arg(meta_bytes, "meta_bytes", 0, 1 << 30)
        if capacity_bytes % ALIGN_BYTES:
            raise InvalidArgument(f"capacity_bytes must be a multiple of {ALIGN_BYTES}, got "
                                  f"{capacity_bytes}", "capacity_bytes", capacity_bytes)
        data_offset = align_up(SEGMENT_HEADER.size + meta_bytes)
        total_bytes = data_offset + capacity_bytes
        try:
            shm = _create_exclusive(name, mode)
        except posix_ipc.PermissionsError as exc:
            raise SegmentPermissionError(
                f"cannot create shared memory {name!r}: {exc}; choose another name", name
            ) from None
        self = object.__new__(cls)
        self.name = name
        self.is_owner = True
        try:
            os.fchmod(shm.fd, mode)  # shm_open applies the umask; the caller asked for `mode`
            self.kind = kind
            self.n_readers = n_readers
            self.data_offset = data_offset
            self.capacity_bytes = capacity_bytes
            self.total_bytes = total_bytes
            self.writer_pid = os.getpid()
            self.epoch = secrets.randbits(63) | 1  # never 0, so a zeroed header never matches
            self.created_ns = time.time_ns()
            header = SEGMENT_HEADER.pack(
                MAKING_MAGIC, LAYOUT_VERSION, kind, n_readers, data_offset,
                capacity_bytes, total_bytes, self.writer_pid, self.epoch, self.created_ns,
            )
            # First, before gigabytes are reserved and faulted in: a writer killed during that
            # leaves a name that `shmstore ls/gc` and the next create recognise as its.
            os.pwrite(shm.fd, header, 0)
            _reserve(shm.fd, name, total_bytes)
            self._map(shm.fd, total_bytes, prefault)
            self.buf[0:8] = MAGIC  # last: attachers see a complete header or none
        except BaseException:
            self.close()
            self.unlink()
            raise
        finally:
            shm.close_fd()
        return self

    @classmethod
    def attach(cls, name: str, *, kind: int, prefault: bool = True) -> Segment:
        """Map an existing segment made by the layer of `kind`.

        Raises:
            SegmentNotFound, SegmentPermissionError, SegmentTooSmall, BadMagic, VersionMismatch,
            WrongSegmentKind: each message says what to do.
        """
        validate_name(name)
        try:
            shm = posix_ipc.SharedMemory(_posix_name(name))
        except posix_ipc.ExistentialError:
            raise SegmentNotFound(
                f"no shared memory named {name!r} in {SHM_DIR}: start the writer that creates it "
                "first, or check the name", name
            ) from None
        except posix_ipc.PermissionsError:
            raise SegmentPermissionError(
                f"no permission to open shared memory {name!r}: it belongs to another user or its "
                "mode forbids you; run as the writer's user, or have the writer create it with a "
                "wider mode (e.g. mode=0o660)", name
            ) from None
        self = object.__new__(cls)
        self.name = name
        try:
            size = os.fstat(shm.fd).st_size
            if size < SEGMENT_HEADER.size:
                raise SegmentTooSmall(
                    f"shared memory {name!r} is {size} bytes, smaller than a shmstore header "
                    f"({SEGMENT_HEADER.size} bytes): it is not a shmstore segment, or its writer "
                    "is still creating it (retry in a moment)", name
                )
            self._map(shm.fd, size, prefault)
            self._read_header(size, kind)
        except BaseException:
            self.close()
            raise
        finally:
            shm.close_fd()
        return self

    def _map(self, fd: int, size: int, prefault: bool) -> None:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
        self._mmap = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._buf = memoryview(self._mmap)
        self._words = OrderedWords(self._mmap)

    def _read_header(self, size: int, kind: int) -> None:
        (magic, version, seg_kind, n_readers, data_offset, capacity_bytes, total_bytes,
         writer_pid, epoch, created_ns) = SEGMENT_HEADER.unpack_from(self.buf, 0)
        name = self.name
        if magic != MAGIC:
            raise BadMagic(
                f"shared memory {name!r} is not a shmstore segment (magic {magic!r}, expected "
                f"{MAGIC!r}), or its writer is still creating it; check the name", name
            )
        if version != LAYOUT_VERSION:
            raise VersionMismatch(
                f"segment {name!r} has layout version {version}, this shmstore reads version "
                f"{LAYOUT_VERSION}: run the same shmstore version in the writer and the readers",
                name,
            )
        if seg_kind != kind:
            raise WrongSegmentKind(
                f"segment {name!r} holds a {KIND_NAMES.get(seg_kind, f'kind {seg_kind}')}, "
                f"expected a {KIND_NAMES.get(kind, f'kind {kind}')}: check the name", name
            )
        if (data_offset < SEGMENT_HEADER.size or data_offset % ALIGN_BYTES
                or total_bytes != data_offset + capacity_bytes):
            raise SegmentTooSmall(
                f"segment {name!r} has an inconsistent header (data_offset {data_offset}, "
                f"capacity {capacity_bytes}, total {total_bytes} bytes): it is corrupt; "
                "recreate it", name
            )
        if total_bytes > size:
            raise SegmentTooSmall(
                f"segment {name!r} is {size} bytes but its header says {total_bytes}: it was "
                "truncated; recreate it", name
            )
        self.kind = seg_kind
        self.n_readers = n_readers
        self.data_offset = data_offset
        self.capacity_bytes = capacity_bytes
        self.total_bytes = total_bytes
        self.writer_pid = writer_pid
        self.epoch = epoch
        self.created_ns = created_ns

    @staticmethod
    def remove_stale(name: str) -> bool:
        """Unlink `name` if its writer is dead; return whether it was removed.

        Raises:
            SegmentExists: the writer is alive (never removes a live segment).
        """
        validate_name(name)
        if not _regular_file(name):
            return False  # nothing, or not shared memory: not ours to remove
        pid = _peek_writer_pid(name)
        if pid is not None and pid_alive(pid):
            raise _exists_error(name)
        try:
            posix_ipc.unlink_shared_memory(_posix_name(name))
        except posix_ipc.ExistentialError:
            return False
        return True

    # -- access ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._buf is None

    @property
    def buf(self) -> memoryview:
        """The whole mapping as a writable memoryview; valid until close()."""
        if self._buf is None:
            raise SegmentClosed(f"segment {self.name!r} is closed; attach it again to use it")
        return self._buf

    @property
    def words(self) -> OrderedWords:
        """Acquire/release access to aligned 8-byte words of the mapping."""
        if self._words is None:
            raise SegmentClosed(f"segment {self.name!r} is closed; attach it again to use it")
        return self._words

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap this process's view; idempotent. Views still alive keep the pages mapped."""
        if self._words is not None:
            self._words.release()
            self._words = None
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._mmap is not None:
            mapping, self._mmap = self._mmap, None
            try:
                mapping.close()
            except BufferError:
                # Arrays from a zero-copy view are still alive. Unmapping now would turn their
                # next access into a crash; the mapping goes away when the last of them does.
                warnings.warn(
                    f"segment {self.name!r} closed while zero-copy views still point into it; "
                    "its memory stays mapped until they are deleted",
                    ResourceWarning,
                    stacklevel=2,
                )

    def unlink(self) -> None:
        """Remove the name from /dev/shm (owner only); idempotent. Mappings stay valid."""
        if not self.is_owner or self._unlinked:
            return
        self._unlinked = True
        try:
            posix_ipc.unlink_shared_memory(_posix_name(self.name))
        except posix_ipc.ExistentialError:
            pass

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.total_bytes} bytes"
        role = "owner" if self.is_owner else "attached"
        return f"<Segment {self.name!r} {KIND_NAMES.get(self.kind, self.kind)}, {role}, {state}>"


def _reserve(fd: int, name: str, total_bytes: int) -> None:
    """Reserve every page now, so a full /dev/shm fails here and never as SIGBUS later."""
    if total_bytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, total_bytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        free = shm_free_bytes()
        free_text = "unknown" if free is None else f"{free / 2**20:.1f} MiB"
        raise ShmSpaceError(
            f"cannot reserve {total_bytes / 2**20:.1f} MiB of shared memory for {name!r}: "
            f"{SHM_DIR} has {free_text} free. Use a smaller capacity, remove leftover segments "
            "(shmstore gc), or give the container more shared memory (docker run --shm-size=8g, "
            "or remount /dev/shm with a larger size=)", total_bytes, free
        ) from exc


def _exists_error(name: str) -> SegmentExists:
    if not _regular_file(name):
        return SegmentExists(
            f"{SHM_DIR}/{name} exists and is not a shared-memory object (a FIFO, socket, device, "
            "directory or link that someone made there): choose another name, or remove it if "
            "nothing uses it", name, None, False
        )
    pid = _peek_writer_pid(name)
    if pid is None:
        return SegmentExists(
            f"shared memory {name!r} already exists and is not a complete shmstore segment: "
            f"choose another name, or remove {SHM_DIR}/{name} if nothing uses it", name, None, False
        )
    if pid_alive(pid):
        return SegmentExists(
            f"segment {name!r} is in use by a live writer (pid {pid}): only one writer may own a "
            "name; choose another name or stop that process", name, pid, True
        )
    return SegmentExists(
        f"segment {name!r} was left behind by writer pid {pid}, which is no longer running: "
        f"remove it (Segment.remove_stale({name!r}) or rm {SHM_DIR}/{name}) and create it again",
        name, pid, False,
    )


def _create_exclusive(name: str, mode: int) -> posix_ipc.SharedMemory:
    """O_CREAT|O_EXCL the name, taking over a stale shmstore segment of a dead writer once."""
    try:
        return posix_ipc.SharedMemory(_posix_name(name), flags=posix_ipc.O_CREX, mode=mode, size=0)
    except posix_ipc.ExistentialError:
        pid = _peek_writer_pid(name)
        if pid is None or pid_alive(pid):
            raise _exists_error(name) from None
    log.warning("taking over shared memory %r left by writer pid %d, which is no longer running",
                name, pid)
    try:
        posix_ipc.unlink_shared_memory(_posix_name(name))
    except posix_ipc.ExistentialError:
        pass
    try:
        return posix_ipc.SharedMemory(_posix_name(name), flags=posix_ipc.O_CREX, mode=mode, size=0)
    except posix_ipc.ExistentialError:  # another process took it over first
        raise _exists_error(name) from None


def _regular_file(name: str) -> bool:
    """Whether SHM_DIR/name is a regular file (what shm_open makes), without opening it: a FIFO
    opened for reading would block, and one opened read-write cannot be read at an offset."""
    try:
        return stat.S_ISREG(os.lstat(os.path.join(SHM_DIR, name)).st_mode)
    except OSError:
        return False


def peek_header(name: str) -> tuple[int, int, int] | None:
    """(kind, n_readers, writer pid) of a shmstore segment, complete or being made, read without
    mapping it; None if there is none of that name (or only something that is not one)."""
    if not _regular_file(name):
        return None
    try:
        shm = posix_ipc.SharedMemory(_posix_name(name))
    except posix_ipc.Error:
        return None
    try:
        header = os.pread(shm.fd, SEGMENT_HEADER.size, 0)
    except OSError:  # replaced by something that is not a file meanwhile
        return None
    finally:
        shm.close_fd()
    if len(header) < SEGMENT_HEADER.size or header[:8] not in (MAGIC, MAKING_MAGIC):
        return None
    fields = SEGMENT_HEADER.unpack(header)
    return int(fields[2]), int(fields[3]), int(fields[7])


def _peek_writer_pid(name: str) -> int | None:
    header = peek_header(name)
    return None if header is None else header[2]

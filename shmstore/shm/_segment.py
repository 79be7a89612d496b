"""Segment: one POSIX shared-memory object, its fixed header, its mapping.

The header every segment starts with is drawn and defined in _header.py.

Who may call what: the creating process (the owner) may `unlink()`; any process may `attach()`
and `close()`. Memoryviews from `buf` stay valid until `close()`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import time
import warnings
import weakref
from collections.abc import Callable
from types import TracebackType

import posix_ipc

from .._proc import env_switch, int_arg, pid_alive
from ..errors import (
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
from . import _exit
from ._closeable import Closeable
from ._header import (
    ALIGN_BYTES,
    KIND_NAMES,
    KIND_QUEUE,
    KIND_RING,
    LAYOUT_VERSION,
    MAGIC,
    MAKING_MAGIC,
    MAX_CAPACITY_BYTES,
    MAX_NAME_CHARS,
    SEGMENT_HEADER,
    SHM_DIR,
    align_up,
    peek_header,
    peek_writer_pid,
    posix_name,
    regular_file,
    shm_free_bytes,
    validate_name,
)
from ._ordering import Words, ordered_words
from ._tracker import Held, locked_unlink

log = logging.getLogger("shmstore")

__all__ = [
    "Segment",
    # the header, defined in _header.py
    "ALIGN_BYTES",
    "KIND_NAMES",
    "KIND_QUEUE",
    "KIND_RING",
    "LAYOUT_VERSION",
    "MAGIC",
    "MAKING_MAGIC",
    "MAX_CAPACITY_BYTES",
    "MAX_NAME_CHARS",
    "SEGMENT_HEADER",
    "SHM_DIR",
    "align_up",
    "peek_header",
    "shm_free_bytes",
    "validate_name",
]

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
    _words: Words | None = None
    _unlinked = False
    _held_fd = -1  # the owner's descriptor of its segment, holding a shared flock (see create)

    def __init__(self) -> None:
        raise TypeError("use Segment.create(...) or Segment.attach(...)")

    # -- construction ------------------------------------------------------------------------

    @staticmethod
    def total_bytes_for(capacity_bytes: int, meta_bytes: int) -> int:
        """Bytes a segment with these areas takes in /dev/shm (what create reserves)."""
        return align_up(SEGMENT_HEADER.size + meta_bytes) + capacity_bytes

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
        _sweep_once()
        capacity_bytes = int_arg(capacity_bytes, "capacity_bytes", 0, MAX_CAPACITY_BYTES)
        meta_bytes = int_arg(meta_bytes, "meta_bytes", 0, 1 << 30)
        if capacity_bytes % ALIGN_BYTES:
            raise InvalidArgument(f"capacity_bytes must be a multiple of {ALIGN_BYTES}, got "
                                  f"{capacity_bytes}", "capacity_bytes", capacity_bytes)
        data_offset = align_up(SEGMENT_HEADER.size + meta_bytes)
        total_bytes = Segment.total_bytes_for(capacity_bytes, meta_bytes)
        _exit.prepare()
        try:
            shm = _create_exclusive(name, mode)
        except posix_ipc.PermissionsError as exc:
            raise SegmentPermissionError(
                f"cannot create shared memory {name!r}: {exc}; choose another name", name
            ) from None
        self = object.__new__(cls)
        self.name = name
        self.is_owner = True
        _exit.own(os.path.join(SHM_DIR, name))
        try:
            # Held until close(), and by no one else: a remover (remove_stale, a takeover, the
            # sweep) that cannot take the file's lock knows a live writer owns it, whatever
            # pid namespace that writer runs in. The kernel drops it when the writer dies.
            # A description of its own (a dup, as mmap makes, would share the lock with the
            # mapping, which a forked child keeps), opened through this process's descriptor
            self._held_fd = os.open(f"/proc/self/fd/{shm.fd}", os.O_RDONLY | os.O_CLOEXEC)
            _HELD.add(self)
            fcntl.flock(self._held_fd, fcntl.LOCK_SH)
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
            shm = posix_ipc.SharedMemory(posix_name(name))
        except posix_ipc.ExistentialError:
            hint = "start the writer that creates it first, or check the name"
            if os.path.exists(os.path.join(SHM_DIR, f"{name}.store")) and os.path.exists(
                    os.path.join(SHM_DIR, f"{name}.queue")):  # a Channel's two segments
                hint = (f"{name!r} is a Channel (its segments are {name}.store and "
                        f"{name}.queue): attach it with Channel.attach({name!r}, reader=...)")
            raise SegmentNotFound(
                f"no shared memory named {name!r} in {SHM_DIR}: {hint}", name) from None
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
        self._words = ordered_words(self._mmap)

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
        if not regular_file(name):
            return False  # nothing, or not shared memory: not ours to remove
        return _unlink_if_dead(name)

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
    def words(self) -> Words:
        """Acquire/release access to aligned 8-byte words of the mapping."""
        if self._words is None:
            raise SegmentClosed(f"segment {self.name!r} is closed; attach it again to use it")
        return self._words

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap this process's view; idempotent. Views still alive keep the pages mapped."""
        self._release_held()
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

    def _release_held(self) -> None:
        fd, self._held_fd = self._held_fd, -1
        _HELD.discard(self)
        if fd >= 0:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the name from /dev/shm (owner only); idempotent. Mappings stay valid."""
        if not self.is_owner or self._unlinked:
            return
        self._unlinked = True
        _exit.disown(os.path.join(SHM_DIR, self.name))
        _unlink_name(self.name)

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


_HELD: weakref.WeakSet[Segment] = weakref.WeakSet()  # owners whose flock this process holds


def _after_fork_in_child() -> None:
    # A forked child shares its parent's open descriptions, and with them the flock: closed
    # here, so that the lock goes when the writer goes (the child never owns the segment).
    for segment in list(_HELD):
        segment._release_held()


os.register_at_fork(after_in_child=_after_fork_in_child)


_SWEEP_EXTRA: dict[int, Callable[[str, int], object]] = {}  # kind -> what else goes with one
_swept_in = 0  # the pid that swept: once per process (a forked child sweeps again)
SWEEP_ENV = "SHMSTORE_SWEEP"  # 0: a writer's first create sweeps nothing (`shmstore gc` still does)


def on_sweep(kind: int, remove: Callable[[str, int], object]) -> None:
    """After sweep_dead removes a segment of `kind`, call `remove(name, n_readers)` for what
    its layer keeps beside it (a queue's doorbells)."""
    _SWEEP_EXTRA[kind] = remove


def sweep_dead() -> list[str]:
    """Remove every shmstore segment in SHM_DIR whose writer is dead, with what its layer
    registered (on_sweep); return the names removed. What `shmstore gc` does, quietly: a
    segment of a live writer, of another user or of no shmstore is never touched.

    The tracker (_exit.py) removes what a dead writer leaves as it dies; this reclaims what
    it could not (it was killed together with its writer), at the next writer's first create.
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for name in names:
        try:
            validate_name(name)
        except InvalidName:
            continue
        header = peek_header(name)
        if header is None or pid_alive(header[2]):
            continue
        try:
            gone = _unlink_if_dead(name)
        except SegmentExists:  # a new writer took the name meanwhile
            continue
        if gone:
            removed.append(name)
            extra = _SWEEP_EXTRA.get(header[0])
            if extra is not None:
                with contextlib.suppress(Exception):
                    extra(name, header[1])
    if removed:
        log.warning("removed %d segment(s) left by dead writers: %s", len(removed),
                    ", ".join(sorted(removed)))
    return removed


def _sweep_once() -> None:
    global _swept_in
    if _swept_in != os.getpid():
        _swept_in = os.getpid()
        if env_switch(SWEEP_ENV, True):
            sweep_dead()


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
    if not regular_file(name):
        return SegmentExists(
            f"{SHM_DIR}/{name} exists and is not a shared-memory object (a FIFO, socket, device, "
            "directory or link that someone made there): choose another name, or remove it if "
            "nothing uses it", name, None, False
        )
    pid = peek_writer_pid(name)
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


def _unlink_name(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(posix_name(name))
    except posix_ipc.ExistentialError:
        pass


def _unlink_if_dead(name: str) -> bool:
    """Unlink `name` if it still is the shmstore segment of a dead writer of this user; return
    whether it was unlinked (_tracker.locked_unlink: the check and the unlink hold an
    exclusive flock on the segment's file, and the name must still lead to that file when it
    is unlinked: a writer that took the name over meanwhile never loses its segment, and two
    removers of one dead segment unlink it once).

    Raises:
        SegmentExists: the segment's writer is alive.
    """
    pid = 0

    def dead(fd: int) -> bool:
        nonlocal pid
        header = os.pread(fd, SEGMENT_HEADER.size, 0)
        if len(header) < SEGMENT_HEADER.size or header[:8] not in (MAGIC, MAKING_MAGIC):
            return False  # not a shmstore segment: not ours to remove
        pid = SEGMENT_HEADER.unpack(header)[7]
        if pid_alive(pid):
            raise _exists_error(name)
        return True

    try:
        return locked_unlink(os.path.join(SHM_DIR, name), check=dead) is not None
    except Held:  # its writer lives where its pid does not tell
        raise SegmentExists(
            f"segment {name!r} is held by a live writer: its pid {pid} is not one of this "
            "pid namespace (a writer in another container sharing /dev/shm, or a process "
            "forked from the writer that still holds it); only one writer may own a name: "
            "choose another name or stop that process", name, pid, True) from None


def _create_exclusive(name: str, mode: int) -> posix_ipc.SharedMemory:
    """O_CREAT|O_EXCL the name, taking over a stale shmstore segment of a dead writer once."""
    try:
        return posix_ipc.SharedMemory(posix_name(name), flags=posix_ipc.O_CREX, mode=mode, size=0)
    except posix_ipc.ExistentialError:
        pid = peek_writer_pid(name)
        if pid is None or pid_alive(pid):
            raise _exists_error(name) from None
    log.warning("taking over shared memory %r left by writer pid %d, which is no longer running",
                name, pid)
    _unlink_if_dead(name)  # False: gone or replaced meanwhile; the create below says which
    try:
        return posix_ipc.SharedMemory(posix_name(name), flags=posix_ipc.O_CREX, mode=mode, size=0)
    except posix_ipc.ExistentialError:  # another process took it over first
        raise _exists_error(name) from None



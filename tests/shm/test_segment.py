"""Segment: exclusive create, header layout, attach errors, lifecycle, space reservation."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from shmstore._proc import proc_stat
from shmstore.shm._segment import (
    KIND_QUEUE,
    KIND_RING,
    LAYOUT_VERSION,
    MAGIC,
    SEGMENT_HEADER,
    SHM_DIR,
    pid_alive,
)
from tests._names import (
    BadMagic,
    InvalidName,
    Segment,
    SegmentClosed,
    SegmentExists,
    SegmentNotFound,
    SegmentTooSmall,
    ShmSpaceError,
    VersionMismatch,
    WrongSegmentKind,
)
from tests._shm import leader_gone
from tests._waiting import wait_for


def test_header_offsets_match_the_documented_layout() -> None:
    buf = bytearray(SEGMENT_HEADER.size)
    SEGMENT_HEADER.pack_into(buf, 0, MAGIC, 1, 2, 3, 64, 5, 69, 7, 8, 9)
    u32 = lambda o: int.from_bytes(buf[o:o + 4], "little")  # noqa: E731
    u64 = lambda o: int.from_bytes(buf[o:o + 8], "little")  # noqa: E731
    assert buf[0:8] == MAGIC
    assert (u32(8), u32(12), u32(16), u32(20)) == (1, 2, 3, 64)
    assert (u64(24), u64(32), u64(40), u64(48), u64(56)) == (5, 69, 7, 8, 9)
    assert SEGMENT_HEADER.size == 64


def test_create_attach_share_bytes_and_header(name: str) -> None:
    with Segment.create(name, kind=KIND_RING, capacity_bytes=4096, meta_bytes=100, n_readers=3) as seg:
        assert seg.data_offset == 192 and seg.total_bytes == 192 + 4096
        mode = stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode)
        assert mode == 0o600
        other = Segment.attach(name, kind=KIND_RING)
        try:
            assert (other.epoch, other.n_readers, other.capacity_bytes) == (seg.epoch, 3, 4096)
            assert other.writer_pid == os.getpid() and not other.is_owner
            seg.buf[seg.data_offset] = 0xAB
            assert other.buf[other.data_offset] == 0xAB
        finally:
            other.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_attach_from_an_unrelated_process_by_name_only(name: str) -> None:
    with Segment.create(name, kind=KIND_RING, capacity_bytes=4096) as seg:
        seg.buf[seg.data_offset:seg.data_offset + 5] = b"hello"
        code = (
            "import sys; from shmstore.shm._segment import Segment, KIND_RING; "
            f"s = Segment.attach({name!r}, kind=KIND_RING); "
            "sys.stdout.write(bytes(s.buf[s.data_offset:s.data_offset + 5]).decode()); s.close()"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout == "hello"


def test_second_create_names_the_live_writer(name: str) -> None:
    with Segment.create(name, kind=KIND_RING, capacity_bytes=4096):
        with pytest.raises(SegmentExists, match=f"live writer \\(pid {os.getpid()}\\)") as info:
            Segment.create(name, kind=KIND_RING, capacity_bytes=4096)
        assert info.value.writer_alive and info.value.writer_pid == os.getpid()
        with pytest.raises(SegmentExists):
            Segment.remove_stale(name)


def _leave_stale(name: str) -> None:
    code = (
        "import os; from shmstore.shm._segment import Segment, KIND_RING; "
        f"Segment.create({name!r}, kind=KIND_RING, capacity_bytes=4096); "
        "os._exit(0)"  # dies without unlinking (no exit handler runs, as after SIGKILL)
    )
    # the tracker off: as if it was killed together with its writer (what it would reclaim)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, "SHMSTORE_TRACKER": "0"})


def test_a_new_writer_takes_over_the_segment_of_a_dead_one(
        name: str, caplog: pytest.LogCaptureFixture) -> None:
    # this process's first create sweeps dead writers' segments: done before, as in a
    # writer that made others already, so that this one is taken over by its create
    with Segment.create(name + "-first", kind=KIND_RING, capacity_bytes=4096):
        pass
    _leave_stale(name)
    with Segment.create(name, kind=KIND_RING, capacity_bytes=8192) as seg:
        assert seg.writer_pid == os.getpid() and seg.capacity_bytes == 8192
    assert "taking over" in caplog.text


def test_stale_segment_can_be_removed(name: str) -> None:
    _leave_stale(name)
    assert Segment.remove_stale(name) is True
    assert Segment.remove_stale(name) is False
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_remover_racing_a_new_writer_never_unlinks_the_new_segment(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`shmstore rm` / gc / remove_stale checks the dead writer, and in that very moment a new
    writer takes the name over: the remover must unlink the dead segment at most, never the new
    one. The race is forced: the remover's liveness check starts the new writer and gives it a
    second to take the name over before answering."""
    import shmstore.shm._segment as segment_module

    _leave_stale(name)
    real = segment_module.pid_alive
    takers: list[subprocess.Popen[str]] = []

    def check_while_a_writer_takes_over(pid: int) -> bool:
        if not takers:
            takers.append(subprocess.Popen([sys.executable, "-c", (
                "import sys, time; from shmstore.shm._segment import Segment, KIND_RING; "
                f"s = Segment.create({name!r}, kind=KIND_RING, capacity_bytes=8192); "
                "print('made', flush=True); sys.stdin.read()")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env={**os.environ, "SHMSTORE_TRACKER": "0"}))  # its segment is left, for below
            time.sleep(1.0)  # time enough to take the name over, were it not locked
        return real(pid)

    monkeypatch.setattr(segment_module, "pid_alive", check_while_a_writer_takes_over)
    taker = None
    try:
        Segment.remove_stale(name)
        monkeypatch.setattr(segment_module, "pid_alive", real)
        taker = takers[0]
        assert taker.stdout is not None and taker.stdout.readline().strip() == "made"
        assert segment_module.peek_writer_pid(name) == taker.pid  # the new segment is there
        with Segment.attach(name, kind=KIND_RING) as seg:
            assert seg.writer_pid == taker.pid
    finally:
        for proc in takers:
            proc.kill()
            proc.wait()
    assert Segment.remove_stale(name) is True  # its writer is gone now


def test_a_foreign_object_is_never_taken_over(name: str) -> None:
    _raw_object(name, b"not ours at all" * 10)
    try:
        with pytest.raises(SegmentExists, match="not a complete shmstore segment"):
            Segment.create(name, kind=KIND_RING, capacity_bytes=4096)
    finally:
        posix_ipc.unlink_shared_memory("/" + name)


def test_attach_missing_name(name: str) -> None:
    with pytest.raises(SegmentNotFound, match="start the writer"):
        Segment.attach(name, kind=KIND_RING)


def test_attach_wrong_kind(name: str) -> None:
    with Segment.create(name, kind=KIND_QUEUE, capacity_bytes=64):
        with pytest.raises(WrongSegmentKind, match="broadcast queue"):
            Segment.attach(name, kind=KIND_RING)


def _raw_object(name: str, content: bytes) -> None:
    shm = posix_ipc.SharedMemory("/" + name, flags=posix_ipc.O_CREX, mode=0o600, size=len(content))
    os.pwrite(shm.fd, content, 0)
    shm.close_fd()


def test_attach_foreign_objects_fail_with_specific_errors(name: str) -> None:
    try:
        _raw_object(name, b"\0" * 10)
        with pytest.raises(SegmentTooSmall, match="smaller than a shmstore header"):
            Segment.attach(name, kind=KIND_RING)
        posix_ipc.unlink_shared_memory("/" + name)

        _raw_object(name, b"NOTOURS!" + b"\0" * 100)
        with pytest.raises(BadMagic, match="not a shmstore segment"):
            Segment.attach(name, kind=KIND_RING)
        posix_ipc.unlink_shared_memory("/" + name)

        header = SEGMENT_HEADER.pack(MAGIC, LAYOUT_VERSION + 1, KIND_RING, 0, 64, 0, 64, 1, 1, 1)
        _raw_object(name, header)
        with pytest.raises(VersionMismatch, match="same shmstore version"):
            Segment.attach(name, kind=KIND_RING)
        posix_ipc.unlink_shared_memory("/" + name)

        header = SEGMENT_HEADER.pack(MAGIC, LAYOUT_VERSION, KIND_RING, 0, 64, 4096, 64 + 4096, 1, 1, 1)
        _raw_object(name, header)  # truncated: header says 4160 bytes
        with pytest.raises(SegmentTooSmall, match="truncated"):
            Segment.attach(name, kind=KIND_RING)
    finally:
        try:
            posix_ipc.unlink_shared_memory("/" + name)
        except posix_ipc.ExistentialError:
            pass


@pytest.mark.parametrize("bad", ["", "a/b", "/abs", ".hidden", "x" * 201, "sp ace", 7])
def test_invalid_names(bad: object) -> None:
    with pytest.raises(InvalidName):
        Segment.create(bad, kind=KIND_RING, capacity_bytes=64)  # type: ignore[arg-type]


def test_random_name_when_none_given() -> None:
    with Segment.create(None, kind=KIND_RING, capacity_bytes=64) as seg:
        assert seg.name.startswith("shmstore-") and os.path.exists(os.path.join(SHM_DIR, seg.name))


def test_close_and_unlink_are_idempotent_and_closed_stays_closed(name: str) -> None:
    seg = Segment.create(name, kind=KIND_RING, capacity_bytes=64)
    seg.close()
    seg.close()
    seg.unlink()
    seg.unlink()
    assert seg.closed
    with pytest.raises(SegmentClosed, match="closed"):
        seg.buf  # noqa: B018


def test_close_with_live_views_warns_and_keeps_memory_valid(name: str) -> None:
    seg = Segment.create(name, kind=KIND_RING, capacity_bytes=4096)
    arr = np.frombuffer(seg.buf, dtype=np.uint8, count=16, offset=seg.data_offset)
    with pytest.warns(ResourceWarning, match="zero-copy views"):
        seg.close()
    seg.unlink()
    assert arr.sum() == 0  # still mapped: no crash
    del arr


def test_full_shm_is_a_clear_error_at_create_and_leaves_nothing(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(ShmSpaceError, match="--shm-size") as info:
        Segment.create(name, kind=KIND_RING, capacity_bytes=1 << 20)
    assert info.value.requested_bytes == 64 + (1 << 20)
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_really_too_large_for_dev_shm(name: str) -> None:
    st = os.statvfs(SHM_DIR)
    beyond_total = st.f_blocks * st.f_frsize + (1 << 30)  # tmpfs refuses this before allocating
    with pytest.raises(ShmSpaceError, match="free"):
        Segment.create(name, kind=KIND_RING, capacity_bytes=beyond_total & ~63, prefault=False)
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    assert not pid_alive(0)
    assert not pid_alive(-5)


def test_a_killed_process_not_yet_reaped_is_dead() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        end = time.monotonic() + 10
        while pid_alive(child.pid) and time.monotonic() < end:  # a zombie until waited for
            time.sleep(0.01)
        assert not pid_alive(child.pid)
        assert os.path.exists(f"/proc/{child.pid}")  # still there, unreaped
    finally:
        child.kill()
        child.wait()


def test_a_process_whose_leader_ended_while_a_thread_runs_is_alive(tmp_path: Path) -> None:
    held = tmp_path / "held"
    held.write_bytes(b"x")
    with leader_gone(str(held)) as proc:
        assert (proc_stat(proc.pid) or ("",))[0] == "Z"  # as /proc shows a SIGKILLed server
        assert pid_alive(proc.pid)  # its thread runs, holding what the process holds
        assert proc.stdin is not None
        proc.stdin.close()  # the thread ends, and the process with it
        wait_for(lambda: not pid_alive(proc.pid), 30, "the process to end")
        assert os.path.exists(f"/proc/{proc.pid}")  # a zombie, not reaped yet: dead


def test_prefault_off_still_works(name: str) -> None:
    with Segment.create(name, kind=KIND_RING, capacity_bytes=1 << 20, prefault=False) as seg:
        seg.buf[-1] = 1
        assert seg.buf[-1] == 1


@pytest.mark.alone  # the sweep removes every dead writer's segments, other tests' too
def test_a_live_writer_whose_pid_this_namespace_cannot_see_is_never_removed(name: str) -> None:
    """A writer in another container that shares /dev/shm (docker --ipc=host, a pod's
    hostIPC) has a pid that means nothing here: its header pid looks dead. Its flock on the
    segment says it lives: remove_stale, a create of the name, the sweep and `shmstore gc`
    leave it alone, and once it is gone (the lock with it) it is removed."""
    from shmstore._proc import PID_MAX_LIMIT
    from shmstore.shm import _segment as segment_module

    seg = Segment.create(name, kind=KIND_RING, capacity_bytes=4096)
    try:
        seg.buf[40:48] = PID_MAX_LIMIT.to_bytes(8, "little")  # the writer pid: no such process
        with pytest.raises(SegmentExists, match="held by a live writer: its pid 4194304 is "
                                                "not one of this pid namespace") as info:
            Segment.remove_stale(name)
        assert info.value.writer_alive
        with pytest.raises(SegmentExists, match="held by a live writer"):
            Segment.create(name, kind=KIND_RING, capacity_bytes=4096)
        assert name not in segment_module.sweep_dead()
        assert os.path.exists(os.path.join(SHM_DIR, name))
    finally:
        seg.close()  # the writer is gone: its lock with it
    try:
        assert Segment.remove_stale(name) is True
    finally:
        seg.unlink()

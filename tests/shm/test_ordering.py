"""Every ordering path works: the compiled words (_native/_atomic.c, the default where it was
built), libatomic through ctypes (ARM without the compiled module; forced here on x86 in a child
process) and plain loads and stores (x86 without it)."""

from __future__ import annotations

import ctypes.util
import importlib.util
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shmstore.shm._ordering import OrderedWords, Words
from tests.conftest import new_name

CODE = """
import multiprocessing as mp, numpy as np, shmstore, shmstore.shm._ordering as o
from shmstore import BroadcastQueue
assert o.ORDERING == {ordering!r}, o.ORDERING

def reader(name):
    r = BroadcastQueue.attach(name, 0)
    got = [r.get(timeout=30) for _ in range(300)]
    r.close()
    raise SystemExit(0 if got == list(range(300)) else 1)

if __name__ == "__main__":
    w = shmstore.ObjectStore.create({name!r}, capacity_bytes=1 << 20, n_readers=1)
    r = shmstore.ObjectStore.attach({name!r}, reader=0)
    try:
        for i in range(50):
            h = w.put(f"k{{i}}", np.full(50_000, i, np.int32), timeout=1)
            assert int(r.get(h)[0]) == i
        s = w.stats()
        assert s.reader_lag == (0,) and s.evictions > 0, s
    finally:
        r.close(); w.close()
    # another process, a queue of 4 slots: every put waits for the reader, every get for the
    # writer, so both sides sleep on doorbells and wake through the handshake of shm/_wait.py
    q = BroadcastQueue.create({name!r} + "-q", n_readers=1, n_slots=4)
    p = mp.get_context("spawn").Process(target=reader, args=(q.name,))
    p.start()
    try:
        q.wait_for_readers(20)
        for i in range(300):
            q.put(i, timeout=30)
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    finally:
        q.close()
    print("ok")
"""


def run_with_ordering(ordering: str, code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` as a script file (spawned children import its functions) in a child process."""
    env = {**os.environ, "SHMSTORE_ORDERING": ordering}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ordering_child.py"
        script.write_text(code)
        return subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                              text=True, timeout=120)


def compiled_built() -> bool:
    return importlib.util.find_spec("shmstore._native._atomic") is not None


ORDERINGS = [
    pytest.param("compiled", marks=pytest.mark.skipif(not compiled_built(),
                                                      reason="_native/_atomic.c was not built")),
    pytest.param("libatomic", marks=pytest.mark.skipif(ctypes.util.find_library("atomic") is None,
                                                       reason="libatomic not installed")),
    pytest.param("plain", marks=pytest.mark.skipif(platform.machine() != "x86_64",
                                                   reason="plain ordering is for x86-64 only")),
]


@pytest.mark.slow
@pytest.mark.parametrize("ordering", ORDERINGS)
def test_every_ordering_path_round_trips_across_processes(ordering: str) -> None:
    out = run_with_ordering(ordering, CODE.format(name=new_name("atomic"), ordering=ordering))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_the_compiled_module_is_built_where_a_compiler_exists_and_is_the_default() -> None:
    """CI builds it (a C compiler is there): a build that silently lost it would go unnoticed."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here: the module is not expected")
    assert compiled_built(), "_native/_atomic.c was not built: run `pip install -e .` again"
    default = run_with_ordering("", "import shmstore.shm._ordering as o; print(o.ORDERING)")
    assert default.returncode == 0, default.stderr
    assert default.stdout.strip() == "compiled"


def test_without_the_compiled_module_it_falls_back_and_insisting_on_it_says_how_to_fix() -> None:
    hide = ("import sys; sys.modules['shmstore._native._atomic'] = None\n"  # as if never built
            "import shmstore.shm._ordering as o\n")
    fallback = run_with_ordering("", hide + "print(o.ORDERING, o.FULL_FENCE)")
    assert fallback.returncode == 0, fallback.stderr
    expected = "plain" if platform.machine() == "x86_64" else "libatomic"
    assert fallback.stdout.split()[0] == expected
    insisted = run_with_ordering("compiled", hide)
    assert insisted.returncode != 0
    assert "ImportError" in insisted.stderr and "C compiler" in insisted.stderr


def make_words(kind: str, mapping: mmap.mmap) -> Words:
    if kind == "compiled":
        if not compiled_built():
            pytest.skip("_native/_atomic.c was not built")
        from shmstore._native._atomic import Words as CompiledWords

        return CompiledWords(mapping)
    return OrderedWords(mapping)


@pytest.mark.parametrize("kind", ["compiled", "python"])
def test_values_wrap_at_64_bits_instead_of_raising(kind: str) -> None:
    """A counter loaded from damaged memory may be 2**64 - 1; the next store must not raise."""
    mapping = mmap.mmap(-1, 64)
    words = make_words(kind, mapping)
    try:
        words.store_release(0, 2**64 - 1 + 1)
        assert words.load_acquire(0) == 0
        assert words.exchange(8, 2**64 + 5) == 0 and words.load_acquire(8) == 5
        assert words.compare_exchange(8, 5, 2**65 + 7) and words.load_acquire(8) == 7
    finally:
        words.release()
        mapping.close()


def test_compiled_words_refuse_every_offset_outside_or_between_words() -> None:
    """An offset computed from damaged bytes raises; it never touches memory past the mapping."""
    mapping = mmap.mmap(-1, 64)
    words = make_words("compiled", mapping)
    try:
        calls = [(words.load_acquire, ()), (words.store_release, (1,)), (words.exchange, (1,)),
                 (words.compare_exchange, (0, 1))]
        for offset in (-8, -1, 1, 7, 60, 64, 2**40, 2**70):
            for call, rest in calls:
                with pytest.raises((IndexError, OverflowError)):
                    call(offset, *rest)  # type: ignore[operator]
        words.store_release(56, 2**64 - 1)
        assert words.load_acquire(56) == 2**64 - 1 and words.load_acquire(0) == 0
        with pytest.raises(TypeError):
            words.store_release(0, "1")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            words.exchange(0)  # type: ignore[call-arg]
        assert words.load_acquire(0) == 0  # nothing was written by the refused calls
    finally:
        words.release()
        mapping.close()


def test_compiled_words_hold_the_mapping_open_until_released_and_fail_loudly_after() -> None:
    mapping = mmap.mmap(-1, 64)
    words = make_words("compiled", mapping)
    with pytest.raises(BufferError):
        mapping.close()  # exported: the words could otherwise touch unmapped memory
    words.release()
    words.release()  # idempotent
    mapping.close()
    with pytest.raises(ValueError, match="released"):
        words.load_acquire(0)
    with pytest.raises(ValueError, match="released"):
        words.exchange(0, 1)
    with pytest.raises(BufferError):
        make_words("compiled", b"read-only bytes")  # type: ignore[arg-type]


def test_a_value_whose_index_releases_the_words_is_refused_not_written() -> None:
    """A value is converted before the release check: Python code it runs (__index__) that
    releases the words and unmaps the memory cannot make the call write through the pointer
    it had (a segfault before)."""
    if not compiled_built():
        pytest.skip("_native/_atomic.c was not built")
    script = """
import mmap
from shmstore._native._atomic import Words
class Sly:
    def __index__(self):
        words.release()
        mapping.close()
        return 5
for call in ("store_release(0, Sly())", "exchange(0, Sly())", "compare_exchange(0, 0, Sly())",
             "compare_exchange(0, Sly(), 1)"):
    mapping = mmap.mmap(-1, 4096)
    words = Words(mapping)
    try:
        eval("words." + call)
        raise SystemExit(f"{call} wrote through a released mapping")
    except ValueError as exc:
        assert "released" in str(exc), exc
print("refused")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "refused", (done.returncode,
                                                                        done.stderr)


def test_release_and_close_from_another_thread_mid_access_fail_loudly_never_crash() -> None:
    """Another thread releases the words and closes the mapping while this one swaps, loads and
    compares as fast as it can: each call either completes on the live mapping or raises."""
    script = """
import mmap, threading
from shmstore._native._atomic import Words
for _ in range(200):
    mapping = mmap.mmap(-1, 4096)
    words = Words(mapping)
    go = threading.Event()
    def closer():
        go.wait()
        words.release()
        mapping.close()
    t = threading.Thread(target=closer)
    t.start()
    go.set()
    try:
        for i in range(100_000):
            words.exchange(8 * (i % 512), i)
            words.load_acquire(8 * (i % 512))
            words.compare_exchange(0, i, i + 1)
    except ValueError as exc:
        assert "released" in str(exc), exc
    t.join()
print("ok")
"""
    if not compiled_built():
        pytest.skip("_native/_atomic.c was not built")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]  # -11 would be a SIGSEGV
    assert done.stdout.strip() == "ok"


INCREMENTS = """
import mmap, sys
import shmstore.shm._ordering as o
fd = int(sys.argv[1])
mapping = mmap.mmap(fd, 64)
words = o.ordered_words(mapping)
while True:  # both processes start counting together
    ready = words.load_acquire(24)
    if words.compare_exchange(24, ready, ready + 1):
        break
while words.load_acquire(24) < 2:
    pass
done = 0
while done < {n}:
    old = words.load_acquire(0)
    if words.compare_exchange(0, old, old + 1):
        done += 1
words.exchange(8 * int(sys.argv[2]), done)
words.release(); mapping.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("ordering", ORDERINGS)
def test_compare_exchange_loses_no_increment_between_processes(ordering: str, tmp_path: Path) -> None:
    """Two processes add 50,000 each to one word with compare_exchange, starting together:
    exactly 100,000 land (a compare then store that is not atomic loses some)."""
    n = 50_000
    path = tmp_path / "words"
    path.write_bytes(bytes(64))
    with open(path, "r+b") as f:
        env = {**os.environ, "SHMSTORE_ORDERING": ordering}
        procs = [subprocess.Popen([sys.executable, "-c", INCREMENTS.format(n=n), str(f.fileno()),
                                   str(i + 1)], env=env, pass_fds=(f.fileno(),),
                                  stderr=subprocess.PIPE, text=True) for i in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
        mapping = mmap.mmap(f.fileno(), 64)
        words = OrderedWords(mapping)
        try:
            assert [words.load_acquire(o) for o in (0, 8, 16, 24)] == [2 * n, n, n, 2]
        finally:
            words.release()
            mapping.close()

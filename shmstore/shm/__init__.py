"""Shared memory itself: one POSIX segment, the FIFO ring inside it, and what readers share.

    _segment.py    Segment: one POSIX shm object, its header, fallocate, mmap, close/unlink
    _header.py     the header every segment starts with; what a name tells without mapping it
    _ring.py       ShmRingBuffer / RingWriter: allocate and free, strictly FIFO, wraparound
    _readers.py    the reader table the store and the queue both use: attach, liveness
    _wait.py       deadlines (one meaning of None), spin then sleep on a doorbell, EINTR
    _ordering.py   the memory fences readers and the writer rely on (the compiled words of
                   _native/ where built, else ctypes or plain words)
    _closeable.py  close() that waits for calls in flight, and the fork check
    _exit.py       names this process created, unlinked at its exit if it did not, and by
                   its tracker if it ends without exit handlers (a signal, os._exit)
    _tracker.py    the tracker process (standard library only): unlinks a dead writer's names

May import: errors, _proc, _native.
"""

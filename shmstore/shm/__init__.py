"""Shared memory itself: one POSIX segment, the FIFO ring inside it, and what readers share.

    segment.py     Segment: one POSIX shm object, its header, fallocate, mmap, close/unlink
    ring.py        ShmRingBuffer / RingWriter: allocate and free, strictly FIFO, wraparound
    _readers.py    the reader table the store and the queue both use: attach, liveness
    _wait.py       deadlines (one meaning of None), spin then sleep on a doorbell, EINTR
    _ordering.py   the memory fences readers and the writer rely on
    _closeable.py  close() that waits for calls in flight, and the fork check

May import: errors, _proc.
"""

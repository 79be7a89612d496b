"""The object store: put/reserve/get/view keyed by hash, hand-out accounting and the reclaim
loop, on one ring.

    object_store.py  ObjectStore.create / attach, StoreReader
    writer.py        StoreWriter: the single writer's put, reserve, get_cached, give_back
    _space.py        where the next object goes: reclaim, copy forward, wait for readers
    _layout.py       the binary layout of the store's header, reader rows and objects
    policy.py        eviction policies (fifo, reinsert, freq): plain values in, a decision out
    host.py          WriterHost / RemoteWriter: one writer served to other processes

May import: errors, handle, _proc, shm, serde.
"""

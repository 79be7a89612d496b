"""The object store: put/reserve/get/view keyed by hash, hand-out accounting and the reclaim
loop, on one ring.

    object_store.py  ObjectStore.create / attach, StoreReader
    writer.py        StoreWriter: the single writer's put, reserve, get_cached, clear, stats
    _handouts.py     the writer's hand-outs: give back, narrow, end, withdraw, hand out again
    _space.py        where the next object goes: reclaim, copy forward, wait for readers
    _layout.py       the binary layout of the store's header, reader rows and objects
    policy.py        eviction policies: plain values in, a decision out
    _api.py          WriterAPI: the one interface StoreWriter and RemoteWriter meet
    host.py          WriterHost: one writer served to other processes of its user
    remote.py        RemoteWriter: that writer called from another process
    _wire.py         what host and remote say: framing and the one table of operations

May import: errors, handle, _proc, shm, serde.
"""

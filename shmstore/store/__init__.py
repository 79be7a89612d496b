"""The object store: put/reserve/get/view keyed by hash, hand-out accounting and the reclaim
loop, on one ring.

    _object_store.py ObjectStore.create / attach, StoreReader
    _writer.py       StoreWriter: a facade over the parts below, which each own their state
    _guards.py       the writer's one guard mechanism: one_thread, hands_out
    _lender.py       Lender: chunks lent to another process (WriterHost's alone)
    _index.py        the writer's records: Entry, by key and by chunk seq
    _space.py        where the next object goes: reclaim, copy forward, wait for readers;
                     what each reader owes, kept between scrapes (Scrape)
    _handouts.py     the hand-out sequence: give back, narrow, end, withdraw, hand out again
    _ledger.py       the writer's reading of the reader rows: reads owed, readers inside
    _base.py         what writer and readers share: StoreBase, StoreStats
    _layout.py       the binary layouts of the store's meta area, reader rows and objects
    _policy.py       eviction policies: plain values in, a decision out
    _api.py          WriterAPI: the one interface StoreWriter and RemoteWriter meet
    _host.py         WriterHost: one writer served to other processes of its user
    _remote.py       RemoteWriter: that writer called from another process
    _wire.py         what host and remote say: framing and the one table of operations

May import: errors, handle, _proc, shm, serde, local.
"""

"""Caches keyed by mm_hash, and the tools that size them.

    _caches.py    SenderCache / ReceiverCache over a store, or a mirrored LRU
    _hashing.py   mm_hash: a content hash of an image and its processor settings
    _hitsim.py    hit-ratio simulation of every cache kind on a trace

May import: errors, handle, _proc, shm, serde, store.
"""

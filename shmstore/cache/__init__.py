"""Caches keyed by mm_hash, and the tools that size them.

    caches.py     SenderCache / ReceiverCache over a store, or a mirrored LRU
    hashing.py    mm_hash: a content hash of an image and its processor settings
    hitsim.py     hit-ratio simulation of every cache kind on a trace

May import: errors, handle, _proc, shm, serde, store.
"""

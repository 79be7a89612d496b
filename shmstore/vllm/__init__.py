"""The vLLM plugin: shmstore serves vLLM's multimodal processor cache in every deployment shape.

    plugin.py    the `vllm.general_plugins` entry point (imports nothing heavy)
    _env.py      the plugin's environment variable names
    _cache.py    install(): the cache factories and request hooks patched into vLLM
    _nodes.py    the head's Publisher and each node's feed (TP across nodes)
    _requests.py the ledger that settles every hand-out when its request ends

Imports vllm itself only where it runs inside vLLM.

May import: errors, handle, _proc, shm, store, queue, relay, metrics.
"""

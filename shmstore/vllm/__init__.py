"""The vLLM plugin: shmstore serves vLLM's multimodal processor cache in every deployment shape.

    plugin.py    the `vllm.general_plugins` entry point (imports nothing heavy)
    _env.py      the plugin's environment variable names
    _install.py  install(): binds vLLM's cache factories to the plugin's caches
    _config.py   the store's name, size and readers, from vLLM's configuration
    _sender.py   the sender cache, in each API process
    _receiver.py the receiver cache, in each worker
    _items.py    vLLM's items as stored values, and the handle items sent instead
    _hooks.py    the request hooks that make hand-outs follow requests
    _nodes.py    the head's Publisher and each node's feed (TP across nodes)
    _requests.py the ledger that settles every hand-out when its request ends

Imports vllm itself only where it runs inside vLLM.

May import: errors, handle, _proc, shm, store, queue, relay, metrics.
"""

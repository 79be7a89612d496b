"""The vLLM plugin: shmstore serves vLLM's multimodal processor cache in every deployment shape.
It is vLLM's adapter of the serving core (shmstore/serving: the sender's hand-outs, the request
ledger, TP across nodes): vLLM's calls, configuration and item shapes are read here.

    plugin.py      the `vllm.general_plugins` entry point (imports nothing heavy)
    _env.py        the plugin's environment variable names and its logger's
    _vllm.py       the one door to vLLM: everything the plugin uses of the vllm package
    _deployment.py Deployment, read once from vLLM's configuration and the environment
                   (serving/_deployment.py's Shape, and what only vLLM needs)
    _install.py    install(): binds vLLM's cache factories to the plugin's caches
    _sender.py     the sender cache, in each API process (on serving/_sender.py's Sender)
    _metrics.py    the plugin's shmstore_* metrics (each API server's counters, the pool's)
    _receiver.py   the receiver cache, in each worker
    _items.py      vLLM's items as stored values, and the handle items sent instead
    _accel/        the acceleration, behind one switch: lazy images (a hit never decodes)
                   and prompt-update records stored beside the tensors (a hit skips the
                   HF processor whichever API server processed the item)
    _scope.py      a request's processing scope (passed explicitly) and a server task's
                   rendered hand-outs
    _hooks.py      the request hooks that make hand-outs follow requests (serving's ledger)

Only _vllm.py imports vllm, and only where the plugin runs inside vLLM; only
_deployment.py reads vLLM's configuration and the environment (tests/vllm/test_vllm_door.py).

May import: errors, handle, _proc, shm, store, queue, relay, serving, metrics.
"""

from ._env import (
    ACCELERATE_ENV,
    ALLOW_ENV,
    ENABLE_ENV,
    INSECURE_ENV,
    KEYS_ENV,
    LEASE_ENV,
    POLICY_ENV,
    PUBLISH_ENV,
    SETTLE_ENV,
    WAIT_ENV,
)
from .plugin import register

__all__ = ["register", "ENABLE_ENV", "POLICY_ENV", "SETTLE_ENV", "LEASE_ENV", "PUBLISH_ENV",
           "KEYS_ENV", "ALLOW_ENV", "INSECURE_ENV", "WAIT_ENV", "ACCELERATE_ENV"]

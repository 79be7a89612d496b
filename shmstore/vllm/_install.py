"""shmstore as vLLM's `shm` multimodal processor cache: install() binds vLLM's cache factories
to the plugin's caches (imported only by plugin.register).

The caches are in _sender.py (API process) and _receiver.py (workers); the items they send
in _items.py; the request hooks in _hooks.py; TP groups across nodes in _nodes.py.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from typing import Any

from vllm.multimodal.cache import factories

from .._proc import pid_alive, proc_stat
from ..errors import ShmStoreError
from ..shm.segment import Segment, peek_header
from ._config import servable
from ._hooks import install_request_hooks
from ._receiver import ShmstoreReceiverCache
from ._sender import ShmstoreSenderCache

__all__ = ["install"]

log = logging.getLogger("vllm.plugins.shmstore")  # vLLM's handlers print it with its own lines

_REMOVE_AT_EXIT: list[str] = []
EXIT_WAIT_S = 2.0  # how long a parent waits at exit for the writer it killed to be gone


def _remove_if_orphaned(name: str) -> None:
    """The store `name`, if its writer is dead, is unlinked (a live writer's is left alone,
    and so is anything of that name that is not a shmstore segment: vLLM's own)."""
    header = peek_header(name)
    if header is None:
        return
    writer = header[2]
    stat = proc_stat(writer)
    if stat is not None and stat[1] == os.getpid():  # we just killed it (vLLM's launcher)
        deadline = time.monotonic() + EXIT_WAIT_S
        while pid_alive(writer) and time.monotonic() < deadline:
            time.sleep(0.01)
    if pid_alive(writer):
        return
    try:
        if Segment.remove_stale(name):
            log.info("shmstore: removed store %r, whose writer was killed", name)
    except (ShmStoreError, OSError):
        pass  # its writer lives (it unlinks it), or it is not a shmstore segment


def install() -> None:
    """Route vLLM's `shm` cache type to shmstore, where vLLM's factories are bound."""
    import importlib

    original_sender = factories.processor_cache_from_config
    original_receiver = factories.worker_receiver_cache_from_config
    original_type = factories._get_cache_type

    def get_cache_type(vllm_config: Any) -> Any:
        # vLLM turns IPC caching off for several API servers and for DP behind its internal
        # load balancer; one shared store serves those, so `shm` stays `shm` where it can
        cache_type = original_type(vllm_config)
        if (cache_type == "processor_only" and vllm_config.model_config
                .get_multimodal_config().mm_processor_cache_type == "shm"):
            why = servable(vllm_config)
            if why is None:
                return "shm"
            log.warning("shmstore: vLLM's processor-only cache stays (%s)", why)
        return cache_type

    if not getattr(original_type, "_shmstore_hook", False):  # install() may run again
        get_cache_type._shmstore_hook = True  # type: ignore[attr-defined]
        factories._get_cache_type = get_cache_type
    # vLLM names the segment when a process first asks, and sets the name in its environment:
    # ask now, so every process started from here (several API servers, DP engines) shares it
    import vllm.envs as envs

    name = envs.VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME
    if not _REMOVE_AT_EXIT:
        # vLLM's launcher SIGKILLs its API servers at shutdown, often before the writer can
        # unlink the store: whichever process of the server exits after it removes it
        _REMOVE_AT_EXIT.append(name)
        atexit.register(_remove_if_orphaned, name)

    def processor_cache_from_config(vllm_config: Any) -> Any:
        if factories._get_cache_type(vllm_config) == "shm":
            return ShmstoreSenderCache(vllm_config)
        return original_sender(vllm_config)

    def worker_receiver_cache_from_config(vllm_config: Any, shared_worker_lock: Any) -> Any:
        if factories._get_cache_type(vllm_config) == "shm":
            return ShmstoreReceiverCache(vllm_config, shared_worker_lock)
        return original_receiver(vllm_config, shared_worker_lock)

    install_request_hooks()
    patches = {"processor_cache_from_config": processor_cache_from_config,
               "worker_receiver_cache_from_config": worker_receiver_cache_from_config}
    for module_name in ("vllm.multimodal.cache.factories", "vllm.multimodal.cache",
                        "vllm.renderers.base", "vllm.v1.worker.worker_base"):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # another vLLM layout: say so, patch what exists
            log.warning("shmstore vLLM plugin: cannot import %s (%s)", module_name, exc)
            continue
        for attr, replacement in patches.items():
            if hasattr(module, attr):
                setattr(module, attr, replacement)

"""shmstore as vLLM's `shm` multimodal processor cache: install() binds vLLM's cache factories
to the plugin's caches (imported only by plugin.register).

The caches are in _sender.py (API process) and _receiver.py (workers); the items they send
in _items.py; the request hooks in _hooks.py; the engine-neutral core in shmstore/serving.
"""

from __future__ import annotations

import atexit
import logging
import os
import time

from .._proc import pid_alive, proc_stat
from ..errors import SegmentExists, ShmStoreError
from ..serving._log import log_to
from ..shm._segment import Segment, peek_header
from ._deployment import Deployment
from ._env import LOG_NAME
from ._hooks import install_request_hooks
from ._receiver import ShmstoreReceiverCache
from ._sender import ShmstoreSenderCache
from ._vllm import bind_cache_factories, buffer_name

__all__ = ["install"]

log = logging.getLogger(LOG_NAME)

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
        log.info("shmstore: store %r left to its writer (pid %d), which still runs", name,
                 writer)
        return
    try:
        if Segment.remove_stale(name):
            log.info("shmstore: removed store %r, whose writer was killed", name)
    except SegmentExists:  # its lock held by a live process: the writer's tracker retries
        log.info("shmstore: store %r left to its writer's tracker: a live process still "
                 "holds its lock", name)
    except (ShmStoreError, OSError):
        pass  # not a shmstore segment, or gone meanwhile


def install() -> None:
    """Route vLLM's `shm` cache type to shmstore, where vLLM's factories are bound."""
    log_to(LOG_NAME)  # the serving core's lines print where vLLM prints the plugin's
    bind_cache_factories(ShmstoreSenderCache, ShmstoreReceiverCache,
                         lambda vllm_config: Deployment.read(vllm_config).keeps_shm())
    # vLLM names the segment when a process first asks, and sets the name in its environment:
    # ask now, so every process started from here (several API servers, DP engines) shares it
    name = buffer_name()
    if not _REMOVE_AT_EXIT:
        # vLLM's launcher SIGKILLs its API servers at shutdown, often before the writer can
        # unlink the store: whichever process of the server exits after it removes it
        _REMOVE_AT_EXIT.append(name)
        atexit.register(_remove_if_orphaned, name)
    install_request_hooks()

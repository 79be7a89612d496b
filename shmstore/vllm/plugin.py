"""vLLM plugin: shmstore serves vLLM's `shm` multimodal processor cache.

Registered as the `vllm.general_plugins` entry point `shmstore` (see pyproject.toml). vLLM calls
`register()` in every process it starts (API server, engine core, each worker, sometimes a model
inspection subprocess), so importing this module does nothing and imports nothing heavy; the
work happens in `register()`, once per process.

With `mm_processor_cache_type="shm"` (vLLM's `--mm-processor-cache-type shm`), the sender cache
(API process) and each worker's receiver cache become shmstore's (`_sender.py`, `_receiver.py`). Every other
cache type is left to vLLM. Environment:

    SHMSTORE_VLLM=0 (false, off, no)    turn the plugin off: vLLM's own shm cache comes back;
                                        1, true, on, yes or unset: on; anything else is refused
    VLLM_OBJECT_STORAGE_SHM_POLICY      a name of store._policy.POLICIES (default: DEFAULT_POLICY,
                                        adaptive): the store's policy
    VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME vLLM's: the shared-memory name (kept)
    SHMSTORE_VLLM_ACCELERATE=0          no acceleration (_accel): every image decoded as it
                                        arrives and no prompt-update records, as in vLLM
                                        alone (default: JPEGs decoded on a miss only, and a
                                        record beside each item, so any API server's hit
                                        skips the processor)

vLLM's own settings keep their meaning: `mm_processor_cache_gb` is the store's capacity,
`mm_shm_cache_max_object_size_mb` its largest object.
"""

from __future__ import annotations

__all__ = ["register", "ENABLE_ENV", "POLICY_ENV"]

from ._env import ENABLE_ENV, POLICY_ENV

_registered = False


def enabled() -> bool:
    """Whether SHMSTORE_VLLM leaves the plugin on (unset: on); InvalidArgument for a value
    that is not a switch."""
    from .._proc import env_switch

    return env_switch(ENABLE_ENV, True)


def register() -> None:
    """vLLM's entry point: route the `shm` processor cache to shmstore (idempotent)."""
    global _registered
    if not enabled() or _registered:
        return
    import logging

    from ._deployment import check_settings, vllm_refusal
    from ._env import LOG_NAME

    check_settings()  # a bad setting: one error here, before any store or process is made
    why = vllm_refusal()
    if why is not None:  # never a traceback mid-request: vLLM's own cache serves instead
        logging.getLogger(LOG_NAME).warning(
            "shmstore vLLM plugin stands aside, vLLM's own multimodal cache runs: %s", why)
        return
    from ._install import install

    install()
    _registered = True

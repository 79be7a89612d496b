"""Where the plugin's store is and who reads it, from vLLM's own configuration."""

from __future__ import annotations

import os
from typing import Any

from ..shm.segment import peek_header
from ._nodes import node_layout

__all__ = ["settings", "engines", "first_reader", "servable", "local_rank"]


GIB = 1 << 30
MIB = 1 << 20


def settings(vllm_config: Any) -> tuple[str, int, int]:
    """(name, capacity_bytes, max_object_bytes) from vLLM's own configuration."""
    mm_config = vllm_config.model_config.get_multimodal_config()
    capacity = int(mm_config.mm_processor_cache_gb * GIB)
    max_object = min(int(mm_config.mm_shm_cache_max_object_size_mb * MIB), capacity)
    import vllm.envs as envs

    # vLLM's own: the variable if set, else a fresh name per process tree (set in the
    # environment, so the workers it starts find the same segment)
    name = envs.VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME
    return name, capacity, max_object


def engines(vllm_config: Any) -> int:
    """Engines on this node that share the store (API process): several with data parallelism
    behind vLLM's internal or hybrid load balancer, else one."""
    parallel = vllm_config.parallel_config
    if int(parallel.data_parallel_size) <= 1 or parallel.data_parallel_external_lb:
        return 1
    return int(parallel.data_parallel_size_local)


def first_reader(name: str, engine: int, per_engine: int) -> int:
    """The first reader index of DP engine `engine` (its DP rank) in store `name`: the engines
    of a node take per_engine readers each, in rank order. (A DP engine of a dense model no
    longer knows how many engines the node has: the store's reader count says.)"""
    header = peek_header(name)
    engines = max(1, header[1] // per_engine) if header is not None else 1
    return engine % engines * per_engine


def servable(vllm_config: Any) -> str | None:
    """Why shmstore cannot serve this deployment's `shm` cache, None if it can: every engine
    the API servers send to must be on this node (DP engines on other nodes behind the
    internal load balancer are not), and several API servers do not mix with a TP group
    across nodes."""
    parallel = vllm_config.parallel_config
    nodes, _, _ = node_layout(vllm_config)
    dp = int(parallel.data_parallel_size)
    if (dp > 1 and not parallel.data_parallel_external_lb
            and int(parallel.data_parallel_size_local) != dp
            and not parallel.data_parallel_hybrid_lb):
        return "data-parallel engines on other nodes behind the internal load balancer"
    if nodes > 1 and (int(parallel._api_process_count) > 1 or engines(vllm_config) > 1):
        return "several API servers or engines with a tensor-parallel group across nodes"
    return None




def local_rank() -> int:
    """This worker's rank on its node: vLLM's world group once it exists, else LOCAL_RANK."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().local_rank)
    except (ImportError, AssertionError, AttributeError):
        return int(os.environ.get("LOCAL_RANK", "0"))

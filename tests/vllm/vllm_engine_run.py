"""Run one vLLM engine on the tiny LLaVA model and print what the tests check, as JSON.

    python tests/vllm/vllm_engine_run.py MODEL_DIR CACHE_TYPE TP [NNODES NODE_RANK MASTER_PORT]

Image prompts with repeats (each of 3 images sent twice), greedy decoding. Prints the output
token ids and, when shmstore serves the cache, its store statistics and vLLM's cache counters.
With NNODES > 1 the TP group spans simulated nodes on this machine (torch.distributed on
127.0.0.1:MASTER_PORT): rank 0 runs the engine as above; another rank runs vLLM's headless
workers (as `vllm serve --headless` does) until it is terminated.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def engine_args(model: str, cache_type: str, tp: int, nodes: list[int]) -> dict[str, object]:
    args: dict[str, object] = dict(
        model=model, enforce_eager=True, mm_processor_cache_type=cache_type,
        mm_processor_cache_gb=0.05, max_model_len=256, tensor_parallel_size=tp, max_num_seqs=4,
        seed=0)
    if nodes:
        args.update(nnodes=nodes[0], node_rank=nodes[1], master_addr="127.0.0.1",
                    master_port=nodes[2])
    return args


def headless(model: str, cache_type: str, tp: int, nodes: list[int]) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    config = EngineArgs(**engine_args(model, cache_type, tp, nodes)).create_engine_config()
    executor = MultiprocExecutor(config, monitor_workers=False)
    executor.start_worker_monitor(inline=True)


def standard_prompts() -> list[dict[str, object]]:
    """Three images, each sent twice."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
              for _ in range(3)]
    return [{"prompt": "USER: <image>\ndescribe the image ASSISTANT:",
             "multi_modal_data": {"image": images[i % 3]}} for i in range(6)]


def main(model: str, cache_type: str, tp: int, nodes: list[int]) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_args(model, cache_type, tp, nodes))
    started = time.perf_counter()
    outputs = llm.generate(standard_prompts(), SamplingParams(temperature=0.0, max_tokens=8),
                           use_tqdm=False)
    seconds = time.perf_counter() - started
    cache = llm.llm_engine.renderer.mm_processor_cache
    report: dict[str, object] = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "seconds": seconds,
        "cache_class": type(cache).__name__,
        **store_report(cache),
    }
    print("REPORT " + json.dumps(report), flush=True)


def store_report(cache: Any) -> dict[str, object]:
    """What shmstore's store and vLLM's counters say now (nothing for vLLM's own caches)."""
    report: dict[str, object] = {}
    store = getattr(cache, "store", None)
    if store is not None:
        stats = store.stats()
        info = cache.make_stats()
        report.update(puts=stats.puts, hits=stats.hits, reader_lag=list(stats.reader_lag),
                      reader_pids=list(stats.reader_pids), n_readers=stats.n_readers,
                      corrupt_reads=list(stats.corrupt_reads), vllm_hits=info.hits,
                      vllm_total=info.total, segment=stats.name,
                      inline_fallbacks=cache.items["inline"])
        if cache.publisher is not None:
            published = cache.publisher.stats()
            report.update(published=published.messages, nodes_joined=published.nodes_joined,
                          objects_sent=[n.objects_sent for n in published.nodes],
                          refs_sent=[n.refs_sent for n in published.nodes])
    return report


if __name__ == "__main__":
    model, cache_type, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    nodes = [int(a) for a in sys.argv[4:7]]
    if nodes and nodes[1] > 0:
        headless(model, cache_type, tp, nodes)
    else:
        main(model, cache_type, tp, nodes)

"""Run one vLLM engine on the tiny LLaVA model and print what the tests check, as JSON.

    python tests/vllm_engine_run.py MODEL_DIR CACHE_TYPE TP

Image prompts with repeats (each of 3 images sent twice), greedy decoding. Prints the output
token ids and, when shmstore serves the cache, its store statistics and vLLM's cache counters.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(model: str, cache_type: str, tp: int) -> None:
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, enforce_eager=True, mm_processor_cache_type=cache_type,
              mm_processor_cache_gb=0.05, max_model_len=256, tensor_parallel_size=tp,
              max_num_seqs=4, seed=0)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
              for _ in range(3)]
    prompts = [{"prompt": "USER: <image>\ndescribe the image ASSISTANT:",
                "multi_modal_data": {"image": images[i % 3]}} for i in range(6)]
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8),
                           use_tqdm=False)
    seconds = time.perf_counter() - started
    cache = llm.llm_engine.renderer.mm_processor_cache
    report: dict[str, object] = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "seconds": seconds,
        "cache_class": type(cache).__name__,
    }
    store = getattr(cache, "store", None)
    if store is not None:
        stats = store.stats()
        info = cache.make_stats()
        report.update(puts=stats.puts, hits=stats.hits, reader_lag=list(stats.reader_lag),
                      reader_pids=list(stats.reader_pids), n_readers=stats.n_readers,
                      corrupt_reads=list(stats.corrupt_reads), vllm_hits=info.hits,
                      vllm_total=info.total, segment=stats.name)
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

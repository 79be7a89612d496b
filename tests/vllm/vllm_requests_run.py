"""Run one vLLM engine (shmstore's `shm` cache, tiny LLaVA, a store of about six images) through
requests that never reach a worker, and print what the tests check, as JSON.

    python tests/vllm/vllm_requests_run.py MODEL_DIR TP

0. the six standard prompts of tests/vllm/vllm_engine_run.py on the fresh engine, reported as
   that script reports them (`standard`): one engine start serves both scripts' checks at TP 2;
1. refused: an image prompt longer than max_model_len once its image tokens are counted
   (vLLM refuses it after rendering, in process_inputs);
2. aborted while queued: requests with new images added and aborted before the engine steps;
3. after SHMSTORE_VLLM_SETTLE_S: three rounds of six new images (more than the store holds);
   each round's items must go by handle, none inline;
4. reset_mm_cache while the six standard prompts (tests/vllm/vllm_engine_run.py) are queued: they
   must finish with the same tokens as before the reset, and the engine must live on.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.vllm.vllm_engine_run import engine_args, standard_prompts, store_report

PROMPT = "USER: <image>\ndescribe the image ASSISTANT:"


def main(model: str, tp: int) -> None:
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams

    args = engine_args(model, "shm", tp, [])
    args["mm_processor_cache_gb"] = 0.00025  # about six 38 kB images
    llm = LLM(**args)
    engine = llm.llm_engine
    cache = engine.renderer.mm_processor_cache
    store = cache.store
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    rng = np.random.default_rng(1)

    def image() -> Image.Image:
        return Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))

    def prompt(img: Image.Image, text: str = PROMPT) -> dict[str, object]:
        return {"prompt": text, "multi_modal_data": {"image": img}}

    def generate(prompts: list[dict[str, object]]) -> list[list[int]]:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    report: dict[str, object] = {}
    # 0. the standard prompts, as vllm_engine_run.py runs and reports them
    started = time.perf_counter()
    report["standard"] = {"tokens": generate(standard_prompts()),
                          "seconds": time.perf_counter() - started,
                          "cache_class": type(cache).__name__, **store_report(cache)}
    # 1. refused after rendering
    # long enough only with the image's 16 tokens: vLLM checks that after rendering
    tokenizer = llm.get_tokenizer()
    filler = ""
    while len(tokenizer.encode(PROMPT.replace("describe", filler + "describe"))) < 250:
        filler += "the quick brown fox "
    too_long = PROMPT.replace("describe", filler + "describe")
    report["too_long_text_tokens"] = len(tokenizer.encode(too_long))
    try:
        generate([prompt(image(), too_long)])
        report["refused_error"] = None
    except Exception as exc:
        report["refused_error"] = f"{type(exc).__name__}: {exc}"[:300]
    # 2. aborted while queued: added and aborted before the engine steps
    ids = [f"abort-{i}" for i in range(3)]
    for rid in ids:
        engine.add_request(rid, prompt(image()), greedy)
    engine.abort_request(ids)
    report["after_abuse"] = dict(cache.ledger.settled)
    time.sleep(float(os.environ.get("RUN_WAIT_S", "2")))  # past SHMSTORE_VLLM_SETTLE_S
    # 3. rounds of new images: by handle, none inline
    inline = []
    for _ in range(3):
        before = cache.items["inline"]
        generate([prompt(image()) for _ in range(6)])
        inline.append(cache.items["inline"] - before)
    report["inline_per_round"] = inline
    # 4. reset under traffic
    standard = standard_prompts()
    report["tokens"] = generate(standard)
    for i, p in enumerate(standard):
        engine.add_request(f"reset-{i}", p, greedy)
    llm.reset_mm_cache()
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    report["tokens_across_reset"] = [done.get(f"reset-{i}") for i in range(6)]
    report["tokens_after_reset"] = generate(standard)
    stats = store.stats()
    report.update(settled=dict(cache.ledger.settled), withdrawn=stats.withdrawn,
                  give_backs=stats.give_backs, reader_lag=list(stats.reader_lag),
                  corrupt_reads=list(stats.corrupt_reads), segment=stats.name,
                  live_requests=cache.ledger.live_requests)
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

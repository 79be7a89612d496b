"""The benchmark's traces are reproducible and have the behaviours they claim."""

from __future__ import annotations

import sys
from pathlib import Path

from shmstore.cache._hitsim import working_set_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from traces import PREPROCESSOR_BYTES, TraceSpec, make_trace


def test_same_spec_same_trace_other_seed_other_trace() -> None:
    spec = TraceSpec(alpha=0.9, n_requests=3000, seed=5)
    assert make_trace(spec) == make_trace(spec)
    assert make_trace(spec) != make_trace(TraceSpec(alpha=0.9, n_requests=3000, seed=6))


def test_sizes_come_from_real_preprocessors_and_stay_per_image() -> None:
    trace = make_trace(TraceSpec(n_requests=3000))
    assert {size for _, size in trace} <= set(PREPROCESSOR_BYTES.values())
    sizes: dict[str, int] = {}
    for key, size in trace:
        assert sizes.setdefault(key, size) == size
    assert working_set_bytes(trace) == sum(sizes.values())


def test_one_time_images_conversations_and_skew() -> None:
    trace = make_trace(TraceSpec(n_requests=10_000, one_time_share=0.3, alpha=1.2))
    keys = [k for k, _ in trace]
    once = [k for k in keys if k.startswith("once-")]
    assert 0.2 < len(once) / len(keys) < 0.4  # resends of a conversation add to its share

    def quick_repeats(spec: TraceSpec) -> int:
        """Requests whose image was also sent within the previous 30 requests."""
        ks = [k for k, _ in make_trace(spec)]
        return sum(k in ks[max(0, i - 30):i] for i, k in enumerate(ks))

    chatty = quick_repeats(TraceSpec(n_requests=5000, alpha=0.6, conversation_p=0.3))
    silent = quick_repeats(TraceSpec(n_requests=5000, alpha=0.6, conversation_p=0.0))
    assert chatty > 3 * silent + 500  # conversations resend their image within a short window
    skewed = make_trace(TraceSpec(n_requests=10_000, one_time_share=0, conversation_p=0, alpha=1.2))
    flat = make_trace(TraceSpec(n_requests=10_000, one_time_share=0, conversation_p=0, alpha=0.6))
    assert len(set(skewed)) < len(set(flat))


def test_every_family_is_reproducible_with_its_own_shape() -> None:
    from traces import FAMILIES, infinite_hit_ratio, make_family

    for family in FAMILIES:
        trace = make_family(family, 4000, seed=1)
        assert trace == make_family(family, 4000, seed=1) != make_family(family, 4000, seed=2)
        assert 0 < infinite_hit_ratio(trace) < 1
        sizes: dict[str, int] = {}
        assert all(sizes.setdefault(k, n) == n and n > 0 for k, n in trace)
    chat = [k for k, _ in make_family("chat", 4000)]
    own = [k for k in chat if k.startswith("s")]
    assert len(own) > 2 * len(set(own))  # sessions resend their images turn after turn
    models = make_family("models", 4000)
    per_image: dict[str, set[int]] = {}
    for key, n in models:
        per_image.setdefault(key.split("/", 1)[1], set()).add(n)
    assert max(len(s) for s in per_image.values()) > 1  # one image, several models' sizes
    assert {key.split("/")[0] for key, _ in models} == {"llava-1.5", "llava-next", "internvl",
                                                         "qwen2-vl"}
    scan = [k for k, _ in make_family("scan", 4000)]
    assert len(scan) == 30_000 and len({k for k in scan if k.startswith("scan-")}) == 10_000
    bursts = [k for k, _ in make_family("bursts", 5000)]
    assert bursts[2000:2300] == [f"burst2000-{j}" for j in range(300)]  # one-time, in a run

"""The benchmark's traces are reproducible and have the behaviours they claim."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from traces import PREPROCESSOR_BYTES, TraceSpec, make_trace, working_set_bytes


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

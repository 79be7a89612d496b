"""Seeded, reproducible request traces of multimodal items for cache benchmarks.

A trace is a list of (key, nbytes): which image a request carries and the size of its
preprocessed tensors. Three behaviours are mixed:

- popular images, drawn from a Zipf distribution over a catalogue (alpha sets the skew);
- one-time images, seen once and never again;
- multi-turn conversations: a request starts a conversation with probability `conversation_p`,
  and the same image is sent again on each following turn, within a short window of requests.

Sizes come from real preprocessors (float32 pixel_values), each image keeping its own.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass

import numpy as np

# bytes of float32 pixel_values per image, by preprocessor
PREPROCESSOR_BYTES = {
    "llava-1.5 336x336": 3 * 336 * 336 * 4,            # 1,354,752
    "qwen2-vl 448x448": 1024 * 1176 * 4,               # 4,816,896: 1024 patches of 3*2*14*14
    "llava-next 5 tiles": 5 * 3 * 336 * 336 * 4,       # 6,773,760
    "qwen2-vl max pixels": 5104 * 1176 * 4,            # 24,009,216: about 24 MB
}
SIZE_MIX = (0.4, 0.3, 0.2, 0.1)  # share of images per preprocessor, in the order above


@dataclass(frozen=True)
class TraceSpec:
    """Parameters of one synthetic trace."""

    alpha: float = 0.8              # Zipf skew of popular images
    n_requests: int = 20_000
    catalogue: int = 5_000          # popular images to draw from
    one_time_share: float = 0.3     # requests carrying an image never seen again
    conversation_p: float = 0.2     # a request starts a multi-turn conversation
    mean_turns: float = 3.0         # further turns per conversation (geometric)
    turn_window: int = 30           # a turn comes within this many requests of the previous one
    seed: int = 0

    @property
    def label(self) -> str:
        return f"zipf a={self.alpha}"


def make_trace(spec: TraceSpec) -> list[tuple[str, int]]:
    """Return the trace of `spec`: the same list for the same spec, on every machine."""
    rng = random.Random(spec.seed)
    nprng = np.random.default_rng(spec.seed)
    ranks = np.arange(1, spec.catalogue + 1, dtype=np.float64)
    weights = ranks ** -spec.alpha
    popular = nprng.choice(spec.catalogue, size=spec.n_requests, p=weights / weights.sum())
    sizes = list(PREPROCESSOR_BYTES.values())
    size_of: dict[str, int] = {}
    turns: list[tuple[int, int, str]] = []  # (due request index, tie-break, key)
    order = itertools.count()
    trace: list[tuple[str, int]] = []
    one_time = 0
    for i in range(spec.n_requests):
        if turns and turns[0][0] <= i:
            key = heapq.heappop(turns)[2]
        elif rng.random() < spec.one_time_share:
            key = f"once-{one_time}"
            one_time += 1
        else:
            key = f"img-{popular[i]}"
        if key not in size_of:
            size_of[key] = rng.choices(sizes, weights=SIZE_MIX)[0]
        trace.append((key, size_of[key]))
        if rng.random() < spec.conversation_p:
            due = i
            while rng.random() < spec.mean_turns / (spec.mean_turns + 1):
                due += rng.randint(1, spec.turn_window)
                heapq.heappush(turns, (due, next(order), key))
    return trace


def working_set_bytes(trace: list[tuple[str, int]]) -> int:
    """Bytes of all distinct items of the trace."""
    return sum(dict(trace).values())

"""Seeded, reproducible request traces of multimodal items for cache benchmarks.

A trace is a list of (key, nbytes) in request order: which item a request carries and the size
of its preprocessed tensors. Sizes come from real preprocessors (float32 pixel_values), each
item keeping its own. `FAMILIES` names the families the benchmarks run (`make_family`); each
one's docstring gives its parameters, and `infinite_hit_ratio` the best any cache can do.

    zipf-A    popular images (Zipf alpha A over 5,000) + 30% one-time images + conversations
              that resend their image within ~30 requests (`TraceSpec`, `make_trace`)
    chat      multi-turn chats: sessions arrive over time and resend all their images on
              every turn after a think time; 10% of sessions share a popular image
    models    several models' preprocessors behind one cache: the same image is a different
              item per model, sizes from 0.3 to 24 MB (dynamic resolution, tiles)
    bursts    a Zipf stream interrupted by bursts of one-time images (an album upload)
    scan      a Zipf stream through which a batch job sends 10,000 unique images
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
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


def infinite_hit_ratio(trace: list[tuple[str, int]]) -> float:
    """Hit ratio of a cache that never evicts: every request but each item's first."""
    return 1 - len({key for key, _ in trace}) / len(trace)


def _zipf_keys(nprng: np.random.Generator, n: int, catalogue: int, alpha: float,
               prefix: str = "img") -> list[str]:
    weights = np.arange(1, catalogue + 1, dtype=np.float64) ** -alpha
    return [f"{prefix}-{i}" for i in nprng.choice(catalogue, size=n, p=weights / weights.sum())]


def _sized(keys: list[str], rng: random.Random,
           size_of: dict[str, int] | None = None) -> list[tuple[str, int]]:
    """Give each key a size from the preprocessor mix, fixed per key."""
    sizes = list(PREPROCESSOR_BYTES.values())
    size_of = {} if size_of is None else size_of
    return [(k, size_of.setdefault(k, rng.choices(sizes, weights=SIZE_MIX)[0])) for k in keys]


def chat_trace(n_requests: int = 20_000, seed: int = 0, *, arrivals_per_s: float = 2.0,
               mean_turns: float = 4.0, think_s: float = 40.0, shared_share: float = 0.1,
               images_per_session: tuple[int, ...] = (1, 1, 1, 2, 3)) -> list[tuple[str, int]]:
    """Multi-turn chats, ordered by time. Sessions arrive as a Poisson process
    (`arrivals_per_s`); each has 1-3 images (drawn from `images_per_session`) and 1 + a
    geometric number of further turns (mean `mean_turns`), each after an exponential think time
    (mean `think_s`); every turn resends all the session's images. A share `shared_share` of
    sessions asks about a popular image (Zipf 1.0 over 200) instead of its own."""
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    events: list[tuple[float, int, str]] = []
    t = 0.0
    session = 0
    tie = itertools.count()
    while len(events) < n_requests:
        t += rng.expovariate(arrivals_per_s)
        if rng.random() < shared_share:
            images = _zipf_keys(nprng, 1, 200, 1.0, "popular")
        else:
            images = [f"s{session}-img{j}" for j in range(rng.choice(images_per_session))]
        session += 1
        turn_t = t
        while True:
            events.extend((turn_t, next(tie), key) for key in images)
            if rng.random() >= mean_turns / (mean_turns + 1):
                break
            turn_t += rng.expovariate(1 / think_s)
    events.sort()
    return _sized([key for _, _, key in events[:n_requests]], rng)


# models: bytes per item by preprocessor, for the mixed-model family
_MODEL_SIZES = {
    "llava-1.5": lambda rng: PREPROCESSOR_BYTES["llava-1.5 336x336"],
    "llava-next": lambda rng: rng.choice((3, 5)) * 3 * 336 * 336 * 4,          # 2 or 4 tiles + base
    "internvl": lambda rng: rng.randint(1, 7) * 3 * 448 * 448 * 4,             # 1-6 tiles + thumb
    "qwen2-vl": lambda rng: min(16384, max(64, int(rng.lognormvariate(7, 1)))) * 4 * 1176,
}


def models_trace(n_requests: int = 20_000, seed: int = 0, *, alpha: float = 0.9,
                 catalogue: int = 4_000, one_time_share: float = 0.2,
                 model_share: tuple[float, ...] = (0.3, 0.2, 0.2, 0.3)) -> list[tuple[str, int]]:
    """Several models' preprocessors behind one cache. Each request picks a model
    (`model_share`, in the order llava-1.5, llava-next, internvl, qwen2-vl) and an image (Zipf
    `alpha` over `catalogue`, or one-time with `one_time_share`); the item is (model, image),
    its size that model's output for that image: fixed, tiles, or dynamic resolution
    (qwen2-vl: lognormal patches, 64-16384, 4.7 KB each)."""
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    popular = _zipf_keys(nprng, n_requests, catalogue, alpha)
    names = list(_MODEL_SIZES)
    size_of: dict[str, int] = {}
    trace = []
    for i in range(n_requests):
        model = rng.choices(names, weights=model_share)[0]
        image = f"once-{i}" if rng.random() < one_time_share else popular[i]
        key = f"{model}/{image}"
        trace.append((key, size_of.setdefault(key, _MODEL_SIZES[model](rng))))
    return trace


def bursts_trace(n_requests: int = 20_000, seed: int = 0, *, alpha: float = 0.9,
                 catalogue: int = 5_000, every: int = 2_000,
                 burst: int = 300) -> list[tuple[str, int]]:
    """A Zipf stream (`alpha` over `catalogue`) with a burst of `burst` one-time images after
    every `every` requests (an album upload, a crawler)."""
    rng = random.Random(seed)
    stream = iter(_zipf_keys(np.random.default_rng(seed), n_requests, catalogue, alpha))
    keys: list[str] = []
    while len(keys) < n_requests:
        keys.extend(itertools.islice(stream, every))
        at = len(keys)
        keys.extend(f"burst{at}-{j}" for j in range(burst))
    return _sized(keys[:n_requests], rng)


def scan_trace(n_requests: int = 30_000, seed: int = 0, *, alpha: float = 0.9,
               catalogue: int = 5_000, scan: int = 10_000,
               start: float = 0.3) -> list[tuple[str, int]]:
    """A Zipf stream (`alpha` over `catalogue`) through which, from `start` of the way on, a
    batch job sends `scan` unique images, alternating with live requests."""
    rng = random.Random(seed)
    live = iter(_zipf_keys(np.random.default_rng(seed), n_requests, catalogue, alpha))
    keys = list(itertools.islice(live, int(start * n_requests)))
    for j in range(scan):
        keys.append(f"scan-{j}")
        keys.extend(itertools.islice(live, 1))
    keys.extend(live)
    return _sized(keys[:n_requests], rng)


def _zipf_family(alpha: float) -> Callable[[int, int], list[tuple[str, int]]]:
    def make(n_requests: int, seed: int) -> list[tuple[str, int]]:
        return make_trace(TraceSpec(alpha=alpha, n_requests=n_requests, seed=seed))
    return make


FAMILIES: dict[str, Callable[[int, int], list[tuple[str, int]]]] = {
    **{f"zipf-{a}": _zipf_family(a) for a in (0.6, 0.8, 1.0, 1.2)},
    "chat": lambda n, seed: chat_trace(n, seed),
    "models": lambda n, seed: models_trace(n, seed),
    "bursts": lambda n, seed: bursts_trace(n, seed),
    "scan": lambda n, seed: scan_trace(max(n, 30_000), seed),
}


def make_family(name: str, n_requests: int = 20_000, seed: int = 0) -> list[tuple[str, int]]:
    """The trace of family `name` (a key of FAMILIES); scan always has at least 30,000
    requests so that its 10,000 unique images pass through a warm cache."""
    return FAMILIES[name](n_requests, seed)

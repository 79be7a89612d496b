"""Eviction policies of the object store: plain values in, a decision out.

The store owns the bytes and the "reclaim the oldest until the new object fits" loop; when the
oldest object is one that every reader is done with, it asks the policy whether to drop it or
to keep it by copying it to the head. A policy never sees shared memory; it sees keys, a small
use count per object, and sizes. `cache/hitsim.py` runs the same policies on metadata alone.

    fifo      drop it (vLLM's shm cache behaves this way)
    reinsert  FIFO-reinsertion (CLOCK with one bit): keep an object that was handed out again
              since it was (re)written, while the put's copy budget (2x its size) lasts
    freq      the default: a 2-bit use count instead of one bit, and a ghost list. Each hit
              adds one (up to 3); a copy forward takes one off, so an object that stops being
              used goes after at most 3 more passes. The keys of the last evicted objects (4x
              as many as are cached) are remembered: a key that comes back after being evicted
              has proved it is reused, if beyond the ring's reach, and starts at 2 instead of
              0. Copy budget: 4x the put's size.

One-time items go after one pass and are never copied; an item hit once is copied once; the
ghost catches items whose reuse distance is just longer than the ring.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from ..errors import InvalidArgument

__all__ = ["EvictionPolicy", "FifoPolicy", "ReinsertPolicy", "FreqPolicy", "POLICIES",
           "POLICY_IDS", "DEFAULT_POLICY", "make_policy"]

DEFAULT_POLICY = "freq"


class EvictionPolicy:
    """Decides whether the oldest reclaimable object stays; subclasses set `name` and `id`.

    The store calls `admitted` for every new object, `hit` for every hand-out of a cached one,
    `keep` (then `kept` if it copied it) when the object is the oldest, and `evicted` when the
    policy's decision dropped it. A use count lives with the store's record of the object.
    """

    name = ""
    id = 0  # stored in the segment header, so readers and tools can show the policy
    budget_factor = 0  # one put may copy this many times its own ring bytes forward
    max_uses = 1

    def copy_budget(self, chunk_bytes: int) -> int:
        """Bytes one put of `chunk_bytes` may spend copying old objects forward."""
        return self.budget_factor * chunk_bytes

    def admitted(self, key: Hashable) -> int:
        """The use count a newly stored object starts with."""
        return 0

    def hit(self, uses: int) -> int:
        """The use count after one more hand-out."""
        return min(uses + 1, self.max_uses)

    def keep(self, uses: int, chunk_bytes: int, budget_bytes: int) -> bool:
        """Whether the oldest object, of `chunk_bytes` and use count `uses`, is copied to the
        head instead of dropped, with `budget_bytes` of copying left for this put."""
        return False

    def kept(self, uses: int) -> int:
        """The use count of an object just copied forward."""
        return 0

    def evicted(self, key: Hashable, cached: int) -> None:
        """The policy dropped `key`; `cached` objects remain."""

    def clear(self) -> None:
        """Forget any history (the store was cleared)."""


class FifoPolicy(EvictionPolicy):
    """Drop the oldest reclaimable object."""

    name = "fifo"
    id = 1


class ReinsertPolicy(EvictionPolicy):
    """Copy the oldest object forward if it was hit since it was written (budget allowing)."""

    name = "reinsert"
    id = 2
    budget_factor = 2

    def keep(self, uses: int, chunk_bytes: int, budget_bytes: int) -> bool:
        return uses > 0 and chunk_bytes <= budget_bytes


class FreqPolicy(ReinsertPolicy):
    """2-bit use count, decremented by each copy forward, and a ghost list of evicted keys."""

    name = "freq"
    id = 3
    budget_factor = 4
    max_uses = 3
    ghost_start = 2  # use count of a key that returns while its ghost is remembered
    # Ghosts kept per cached object. Measured with bench/bench_hitrate.py's replay on every
    # family at 1-25% of the working set and on four trace seeds: 4x beat 1x in 29-31 of 32
    # cells per seed (3x about the same, 2x less).
    ghost_factor = 4

    def __init__(self) -> None:
        self._ghosts: OrderedDict[Hashable, None] = OrderedDict()

    def admitted(self, key: Hashable) -> int:
        if key in self._ghosts:
            del self._ghosts[key]
            return self.ghost_start
        return 0

    def kept(self, uses: int) -> int:
        return uses - 1

    def evicted(self, key: Hashable, cached: int) -> None:
        ghosts = self._ghosts
        ghosts[key] = None
        ghosts.move_to_end(key)
        while len(ghosts) > self.ghost_factor * cached + 1:
            ghosts.popitem(last=False)

    def clear(self) -> None:
        self._ghosts.clear()

    @property
    def ghosts(self) -> int:
        """Keys remembered now."""
        return len(self._ghosts)


POLICIES: dict[str, type[EvictionPolicy]] = {"fifo": FifoPolicy, "reinsert": ReinsertPolicy,
                                             "freq": FreqPolicy}
POLICY_IDS = {cls.id: name for name, cls in POLICIES.items()}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called `name`.

    Raises:
        InvalidArgument: an unknown name (the message lists the known ones).
    """
    cls = POLICIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidArgument(f"unknown eviction policy {name!r}; choose one of "
                              f"{sorted(POLICIES)}", "policy", name)
    return cls()

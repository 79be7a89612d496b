"""Eviction policies of the object store: plain values in, a decision out.

The store owns the bytes and the "reclaim the oldest until the new object fits" loop; when the
oldest object is one that every reader is done with, it asks the policy whether to drop it or
to keep it by copying it to the head. A policy never sees shared memory.

    fifo      drop it (vLLM's shm cache behaves this way)
    reinsert  FIFO-reinsertion (CLOCK with one bit): keep an object that was handed out again
              since it was (re)written, while the put's copy budget lasts; the copy clears
              its bit, so an object that is not hit again goes next time
"""

from __future__ import annotations

from .errors import InvalidArgument

__all__ = ["EvictionPolicy", "FifoPolicy", "ReinsertPolicy", "POLICIES", "POLICY_IDS",
           "make_policy", "REINSERT_BUDGET_FACTOR"]

REINSERT_BUDGET_FACTOR = 2  # one put may copy at most this many times its own size forward


class EvictionPolicy:
    """Decides whether the oldest reclaimable object stays; subclasses set `name` and `id`."""

    name = ""
    id = 0  # stored in the segment header, so readers and tools can show the policy

    def copy_budget(self, chunk_bytes: int) -> int:
        """Bytes one put of `chunk_bytes` may spend copying old objects forward."""
        return 0

    def keep(self, hit: bool, chunk_bytes: int, budget_bytes: int) -> bool:
        """Whether an object of `chunk_bytes`, hit since it was written or not, is copied to
        the head instead of dropped, with `budget_bytes` of copying left for this put."""
        raise NotImplementedError


class FifoPolicy(EvictionPolicy):
    """Drop the oldest reclaimable object."""

    name = "fifo"
    id = 1

    def keep(self, hit: bool, chunk_bytes: int, budget_bytes: int) -> bool:
        return False


class ReinsertPolicy(EvictionPolicy):
    """Copy the oldest object forward if it was hit since it was written (budget allowing)."""

    name = "reinsert"
    id = 2

    def copy_budget(self, chunk_bytes: int) -> int:
        return REINSERT_BUDGET_FACTOR * chunk_bytes

    def keep(self, hit: bool, chunk_bytes: int, budget_bytes: int) -> bool:
        return hit and chunk_bytes <= budget_bytes


POLICIES: dict[str, type[EvictionPolicy]] = {"fifo": FifoPolicy, "reinsert": ReinsertPolicy}
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

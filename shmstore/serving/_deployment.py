"""Where an engine's store is, who writes it and who reads it, whatever the engine: a frozen
Shape (an adapter reads its engine's configuration into one: vllm/_deployment.py Deployment)
and the one function that picks the writer for this process's shape.

Shapes, as `Shape.shape` names them:

    local    one API server (or API server 0 of several): this process creates the store
             and writes it; with several API servers it also serves the writer to the
             others (WriterHost)
    remote   API server 1..N-1: writes the store through API server 0's WriterHost
    relay    a tensor-parallel group across nodes: this process creates a Channel and its
             relay Publisher; the other nodes' relays write their own stores
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from ..shm._segment import peek_header
from ..store._api import WriterAPI
from ..store._host import WriterHost
from ..store._object_store import ObjectStore, StoreWriter
from ..store._remote import RemoteWriter

__all__ = ["Shape", "Writers", "open_writer"]


@dataclass(frozen=True)
class Shape:
    """One deployment: its store, its API servers, engines and nodes, and its timings."""

    name: str  # the segment
    capacity_bytes: int
    max_object_bytes: int  # at most the capacity
    policy: str  # the store's eviction policy
    api_servers: int
    api_rank: int
    engines: int  # engines on this node that share the store
    engine: int  # this worker's engine (its DP index)
    per_engine: int  # workers of each engine on this node (readers of one reader group)
    nodes: int  # nodes of this TP/PP group
    node_rank: int
    settle_s: float  # after a request ends: when its unread hand-outs go
    lease_s: float  # a hand-out no request claimed: when it goes
    wait_s: float  # node k worker: longest wait for an item's handle
    publish: str  # head of a group across nodes: where its Publisher binds ("" unset)
    keys_file: str  # its CurveZMQ key pair ("" unset)
    allow: tuple[str, ...]  # relays' public key files
    insecure: bool  # plain TCP, no keys

    @property
    def n_readers(self) -> int:
        """Readers of the store on this node: every worker of every engine that shares it."""
        return self.engines * self.per_engine

    @property
    def shape(self) -> str:
        """local, remote or relay (the module docstring says what each is)."""
        if self.nodes > 1:
            return "relay"
        return "remote" if self.api_servers > 1 and self.api_rank > 0 else "local"

    def first_reader(self, name: str) -> int:
        """The first reader index of this worker's engine (its DP rank) in store `name`: the
        engines of a node take per_engine readers each, in rank order. (A DP engine of a
        dense model no longer knows how many engines the node has: the store's reader count
        says.)"""
        header = peek_header(name)
        engines = max(1, header[1] // self.per_engine) if header is not None else 1
        return self.engine % engines * self.per_engine


@dataclass
class Writers:
    """What open_writer made for this process: the writer every call goes to, and what
    serves it to others (a WriterHost, a relay head), closed in order by close()."""

    store: WriterAPI
    local: StoreWriter | None  # the store's own writer, if this process created it
    host: WriterHost | None = None
    head: Any = None  # serving/_nodes.py HeadPublisher, for a TP group across nodes

    @property
    def role(self) -> str:
        return "writes it" if self.local is not None else "writes it through API server 0"

    def close(self) -> None:
        if self.head is not None:
            self.head.close()
        if self.host is not None:
            self.host.close()
        self.store.close()


def open_writer(d: Shape, lock: threading.RLock,
                make_head: Callable[[Callable[..., Any]], Any], *, host: bool = False) -> Writers:
    """The writer for this process's shape: a new store (local), API server 0's through its
    host (remote), or a relay head's channel store (relay, made by `make_head(make)`). `lock`
    is held around every call of the writer (the WriterHost takes it for its clients). A local
    store is served to other processes with several API servers, or with `host` (a miss pool's
    workers write it)."""

    def make(create: Callable[..., Any]) -> Any:
        try:
            return create(capacity_bytes=d.capacity_bytes, max_object_bytes=d.max_object_bytes,
                          policy=d.policy)
        except InvalidArgument as exc:
            if exc.argument != "max_object_bytes":
                raise
            # the limit is about the whole cache: what fits
            return create(capacity_bytes=d.capacity_bytes, policy=d.policy)

    if d.shape == "relay":
        head = make_head(make)
        return Writers(head.channel.store, head.channel.store, head=head)
    if d.shape == "remote":
        return Writers(RemoteWriter(d.name), None)
    # pages are taken as the ring fills, not all at start (vLLM's default capacity is 4 GiB;
    # a server that sees few images should not hold all of it)
    store: StoreWriter = make(lambda **kw: ObjectStore.create(d.name, n_readers=d.n_readers,
                                                             prefault=False, **kw))
    writers = Writers(store, store)
    if d.api_servers > 1 or host:
        try:
            writers.host = WriterHost(store, lock)
        except BaseException:
            with contextlib.suppress(Exception):
                store.close()
            raise
    return writers

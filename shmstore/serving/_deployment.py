"""Where an engine's store is, who writes it and who reads it, whatever the engine: a frozen
Shape (an adapter reads its engine's configuration into one: vllm/_deployment.py Deployment)
and the one function that picks the writer for this process's shape.

Shapes, as `Shape.shape` names them (and open_pool's roles in each):

    local    one API server (or API server 0 of several): this process creates the store
             and writes it; with several API servers it also serves the writer to the
             others (WriterHost); runs the node's miss pool, and serves it to the other
             API servers (PoolHost)
    remote   API server 1..N-1: writes the store through API server 0's WriterHost, and
             submits its misses to API server 0's pool (PoolClient)
    relay    a tensor-parallel group across nodes: this process creates a Channel and its
             relay Publisher; the other nodes' relays write their own stores (no pool)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument, ShmStoreError
from ..shm._segment import peek_header
from ..store._api import WriterAPI
from ..store._host import WriterHost
from ..store._object_store import ObjectStore, StoreWriter
from ..store._remote import RemoteWriter
from ._lending import Lending
from ._log import log
from ._outcome import Outcome, PoolStats, Processor
from ._photos import PhotoOutbox
from ._pool import MissPool
from ._pool_share import PoolClient, PoolHost

__all__ = ["Shape", "Writers", "open_writer", "NodePool", "open_pool"]


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
    pool_workers: int  # the node's miss pool (serving/_pool.py; 0: none)

    @property
    def n_readers(self) -> int:
        """Readers of the store on this node: every worker of every engine that shares it."""
        return self.engines * self.per_engine

    @property
    def pooled(self) -> bool:
        """Whether the node has a miss pool (a TP group across nodes has none)."""
        return bool(self.pool_workers) and self.shape != "relay"

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
    lock: Any = None  # held around every call of `local` (open_writer's)

    def stored(self, key: str) -> bool:
        """Whether the local store has `key` now, asked under the lock (the miss pool's
        dispatcher asks before a job goes to a worker); False, at once, when another thread
        holds the lock: a hint is not worth a wait. A key stored meanwhile is processed, and
        the chunk its worker asks for is refused (STORED: serving/_lending.py)."""
        local = self._own()
        if not self.lock.acquire(blocking=False):
            return False
        try:
            return local.is_cached(key)
        finally:
            self.lock.release()

    def _own(self) -> StoreWriter:
        """The store's own writer; InvalidArgument in a process that did not create it."""
        if self.local is None:
            raise InvalidArgument("only the process that created the store asks it directly "
                                  "and fills it through a miss pool; a remote writer asks its "
                                  "host (cached)", "local", None)
        return self.local

    @property
    def name(self) -> str:
        return self.store.name

    @property
    def epoch(self) -> int:
        return self._own().epoch

    def lending(self) -> Lending:
        """A miss pool worker's chunks of the local store (serving/_lending.py), under the
        writer's lock."""
        return Lending(self._own(), self.lock)

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
                make_head: Callable[[Callable[..., Any]], Any]) -> Writers:
    """The writer for this process's shape: a new store (local), API server 0's through its
    host (remote), or a relay head's channel store (relay, made by `make_head(make)`). `lock`
    is held around every call of the writer (the WriterHost takes it for its clients). A local
    store is served to other processes with several API servers (a miss pool's workers write
    it through the pool: open_pool)."""

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
    writers = Writers(store, store, lock=lock)
    if d.api_servers > 1:
        try:
            writers.host = WriterHost(store, lock)
        except BaseException:
            with contextlib.suppress(Exception):
                store.close()
            raise
    return writers


class NodePool:
    """This process's way into the node's miss pool, as open_pool chose it: the pool itself
    (the store's writer process; served to the node's other API servers when there are
    several), or a client of that one. Meets the Pool protocol; close() closes what it made."""

    def __init__(self, *, pool: MissPool | None = None, host: PoolHost | None = None,
                 client: PoolClient | None = None, unshared: str = "",
                 outbox: PhotoOutbox | None = None) -> None:
        self.pool, self.host, self.client = pool, host, client
        self.unshared = unshared  # why the pool is not served to the other API servers
        self.outbox = outbox  # this API server's photos, read in place by the workers
        self.photos_inline = 0  # photos sent in the job itself (the outbox was full)

    @property
    def waited(self) -> int:
        """Answers whose key was in flight on the node already."""
        if self.pool is not None:
            return self.pool.waited
        return 0 if self.client is None else self.client.waited

    def join(self, key: str, job: Any) -> tuple[Future[Outcome], bool]:
        """The item's future, and whether it was in flight here already (a client learns that
        only from the answer: `waited`)."""
        if self.pool is not None:
            return self.pool.join(key, job)
        if self.client is not None:
            return self.client.join(key, job)
        done: Future[Outcome] = Future()
        done.set_result(Outcome.CLOSED)
        return done, False

    def submit(self, key: str, job: Any) -> Future[Outcome]:
        return self.join(key, job)[0]

    def send(self, key: str, job: dict[str, Any], photo: bytes
             ) -> tuple[Future[Outcome], bool]:
        """join, with the item's original bytes by shared memory: written once into this API
        server's outbox, the job carrying their reference under "photo" (a full outbox: the
        bytes themselves under "bytes"); the chunk is freed when the outcome comes."""
        ref = None if self.outbox is None else self.outbox.put(photo)
        if ref is None:
            self.photos_inline += 1
            return self.join(key, {**job, "bytes": photo})
        try:
            future, waited = self.join(key, {**job, "photo": ref})
        except BaseException:
            self.outbox.done(ref)  # type: ignore[union-attr]
            raise
        outbox = self.outbox
        future.add_done_callback(lambda _: outbox.done(ref))  # type: ignore[union-attr]
        return future, waited

    def stats(self) -> PoolStats | None:
        """The pool's stats, from the process that runs it (None elsewhere)."""
        return None if self.pool is None else self.pool.stats()

    def close(self) -> None:
        for part in (self.client, self.host, self.pool, self.outbox):
            if part is not None:
                part.close()
        self.pool = self.host = self.client = self.outbox = None


def open_pool(d: Shape, writers: Writers, processor: Processor, *,
              env: dict[str, str] | None = None) -> NodePool | None:
    """This process's way into the node's miss pool (None when the shape has none): the
    process that writes the store runs it with d.pool_workers workers and, with several API
    servers, serves it to the others; they submit through a client. A pool whose name cannot
    be served (taken) stays this process's own: logged, kept in `unshared`, never a failed
    start."""
    if not d.pooled:
        return None
    outbox = _outbox(d.name)
    try:
        if writers.local is None:
            return NodePool(client=PoolClient(d.name), outbox=outbox)
        pool = MissPool(writers, processor, workers=d.pool_workers, env=env)
    except BaseException:
        if outbox is not None:
            outbox.close()
        raise
    if d.api_servers == 1:
        return NodePool(pool=pool, outbox=outbox)
    try:
        return NodePool(pool=pool, host=PoolHost(pool, d.name, writers.local.epoch),
                        outbox=outbox)
    except InvalidArgument as exc:  # its name is taken: this API server's pool only
        log.warning("shmstore: the miss pool is not shared with the other API servers (%s): "
                    "their new images take the engine's own path", exc)
        return NodePool(pool=pool, unshared=str(exc), outbox=outbox)
    except BaseException:
        pool.close()
        if outbox is not None:
            outbox.close()
        raise


def _outbox(name: str) -> PhotoOutbox | None:
    """This API server's photo outbox; None where /dev/shm cannot hold one (photos then go in
    the jobs themselves), logged."""
    try:
        return PhotoOutbox(name)
    except ShmStoreError as exc:
        log.warning("shmstore: no photo outbox for the miss pool (%s): photos go in its "
                    "messages", exc)
        return None

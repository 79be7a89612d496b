"""A tensor-parallel group whose workers span machines, fed by shmstore's relay (relay/_node.py).

    head node (node rank 0)                                  node k
    API process: sender                                      `shmstore relay connect ...`
      store <name>.store, queue <name>.queue                   Relay --> channel NAME_k
      every hand-out: to the engine + publish        ...tcp...   |
      Publisher thread (reader L of the channel) ---------------+   workers: NodeFeed each
    workers 0..L-1: read <name>.store by handle (as on one node)   (a free reader of NAME_k)

On the head, the deployment's `publish` names the address the Publisher binds; the store has
the L local workers plus the Publisher as readers. A hand-out goes by handle only while every
other node's relay is connected; before that (or while one is reconnecting) the item goes with
its data, which every worker can use. Each hand-out carries the object id, so a worker on
node k knows the key its relay stored the bytes under.

On node k, `shmstore relay connect tcp://HEAD:PORT --name NAME_k --readers L_k` runs first,
and the engine there reads NAME_k. Each worker attaches a free reader index of NAME_k before
any request (so it misses nothing; the relay waits for all L_k before it connects). An engine
hands items to workers in scheduling order, not in hand-out order: a worker takes the relay's
handles in order, keeps those it does not need yet (owed to it, so the relay's ring keeps
them), and reads the one it needs. The vLLM adapter: vllm/_sender.py and vllm/_receiver.py.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ..errors import (
    BadMagic,
    Closed,
    CorruptObject,
    InvalidArgument,
    ReaderIndexError,
    ReaderSlotBusy,
    SegmentNotFound,
    SegmentTooSmall,
    StaleHandle,
    Timeout,
    WriterGone,
)
from ..handle import Handle, HandOut, key_digest
from ..queue._channel import Channel, ChannelReader, ChannelWriter
from ..shm._header import being_made
from ._log import log

if TYPE_CHECKING:
    from ._deployment import Shape

__all__ = ["HeadPublisher", "NodeFeed", "FEED_ERRORS"]

PUBLISH_TIMEOUT_S = 30.0  # a hand-out waits this long for queue space (a slow node)
MAX_WAITING = 4096  # handles a node-k worker keeps for items it has not been given yet


class HeadPublisher:
    """The head node's side: a Channel whose store the sender cache uses, and its Publisher."""

    def __init__(self, make_channel: Any, d: Shape) -> None:
        """`d`: the Shape (serving/_deployment.py) of a TP group across nodes: its name,
        nodes, n_readers (local), and the Publisher's address (publish, which the adapter
        checked is set), keys_file, allow and insecure."""
        from ..relay import CurveKeys, Publisher, PublisherSecurity

        n_remote_nodes, n_local, name = d.nodes - 1, d.n_readers, d.name
        if not d.publish:
            raise InvalidArgument(f"a TP group across {d.nodes} nodes needs the address its "
                                  "Publisher binds", "publish", None)
        keys = CurveKeys.load(d.keys_file) if d.keys_file else None
        allowed = tuple(CurveKeys.load(p).public for p in d.allow) if d.allow else None
        self.n_remote_nodes = n_remote_nodes
        self.channel: ChannelWriter = make_channel(
            lambda **kw: Channel.create(name, n_readers=n_local + 1, inline_threshold=0, **kw))
        try:
            security = PublisherSecurity(keys, allowed, plaintext=d.insecure)
            self.publisher = Publisher(name, n_local, d.publish, security=security)
        except BaseException:
            self.channel.close()
            raise
        self.publisher.start()
        log.info("shmstore: publishing hand-outs to %d other node(s) on %s", n_remote_nodes,
                 self.publisher.endpoint)

    def ready(self) -> bool:
        """Every other node's relay is connected (a hand-out now reaches all of them), and
        the Publisher still serves (if it stopped, an error is in the log)."""
        return self.publisher.serving and self.publisher.nodes_connected >= self.n_remote_nodes

    def renew(self, handout: HandOut) -> HandOut:
        """Replace a hand-out kept a while by one made now: published hand-outs go out in the
        order they are made (ChannelWriter.publish)."""
        return self.channel.store.hand_out_again(handout.handle)

    def publish(self, handout: HandOut) -> None:
        """Send a hand-out just made to the nodes (Timeout: given back, see ChannelWriter)."""
        self.channel.publish(handout, timeout=PUBLISH_TIMEOUT_S)

    def close(self) -> None:
        """End the channel (relays end theirs: their workers get Closed), stop the Publisher,
        close and unlink the channel; idempotent."""
        if self.channel.closed:
            return
        with contextlib.suppress(Exception):
            self.channel.end()
            self.publisher.result(timeout=2.0)  # it forwards END, then returns
        self.publisher.close()
        self.channel.close()


class NodeFeed:
    """A worker on another node: resolves the head's handle items from this node's relay
    channel, taking the relay's handles in order and the objects in any order. A relay that
    ends or dies is noticed between steps (poll) and a replacement on the same name attached."""

    def __init__(self, name: str, n_local: int, wait_s: float) -> None:
        self.wait_s = wait_s
        self.name = name
        self._n_local = n_local
        self._reader: ChannelReader | None = _attach_free(name, n_local)
        self._kept: deque[Handle] = deque()  # received, not yet asked for (owed to us)
        self._retry_at = 0.0
        self.dropped = self.reattached = 0

    @property
    def reader(self) -> ChannelReader | None:
        """This worker's reader of the relay channel (None while it waits for a new relay)."""
        return self._reader

    def poll(self) -> None:
        """Between steps: take the handles that came, notice a relay that ended or died, and
        attach its replacement (a try per second). Cheap; never waits."""
        reader = self._reader
        if reader is None:
            now = time.monotonic()
            if now < self._retry_at:
                return
            self._retry_at = now + 1.0
            with contextlib.suppress(SegmentNotFound, InvalidArgument):
                self._reader = _attach_free(self.name, self._n_local)
                self.reattached += 1
                log.info("shmstore: worker attached relay channel %r again", self.name)
            return
        try:
            while True:
                try:
                    self._keep(reader.recv_handle(timeout=0))
                except CorruptObject as exc:  # a damaged or inline message: skipped
                    log.warning("shmstore: relay channel %r: %s", self.name, exc)
        except Timeout:
            return
        except (Closed, WriterGone) as exc:
            self._relay_gone(exc)

    def get(self, object_id: bytes) -> Any:
        """The object the head stored as `object_id` (an owned copy).

        Raises:
            Timeout: its handle did not come within wait_s. Closed, WriterGone: the relay's
                channel ended (poll attaches a new one). StaleHandle, CorruptObject: as
                StoreReader.get.
        """
        reader = self._reader
        if reader is None:
            raise Closed(f"relay channel {self.name!r} ended; waiting for a new relay")
        digest = key_digest(object_id)  # the relay stores the bytes under their object id
        for i, handle in enumerate(self._kept):
            if handle.key_digest == digest:
                del self._kept[i]
                return reader.get(handle)
        end = time.monotonic() + self.wait_s
        while True:
            try:
                handle = reader.recv_handle(timeout=max(0.0, end - time.monotonic()))
            except (Closed, WriterGone) as exc:
                self._relay_gone(exc)
                raise
            if handle.key_digest == digest:
                return reader.get(handle)
            self._keep(handle)

    def close(self) -> None:
        self._kept.clear()
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _keep(self, handle: Handle) -> None:
        assert self._reader is not None  # only handles of the current reader are kept
        self._kept.append(handle)
        if len(self._kept) > MAX_WAITING:  # hand-outs no request here ever used
            oldest = self._kept.popleft()
            self.dropped += 1
            with contextlib.suppress(StaleHandle, CorruptObject):
                self._reader.discard(oldest)
            log.warning("shmstore: worker on relay channel %r gave up an item handed out "
                        "%d items ago and never asked for (%d so far)", self.name,
                        MAX_WAITING, self.dropped)

    def _relay_gone(self, exc: Exception) -> None:
        log.warning("shmstore: relay channel %r ended (%s); items come inline until a new relay "
                    "runs on this node", self.name, exc)
        self.close()


FEED_ERRORS = (Timeout, Closed, WriterGone)  # what NodeFeed.get adds to a reader's errors


def _attach_free(name: str, n_local: int) -> ChannelReader:
    """Attach the first free reader index of the node's relay channel `name`."""
    for index in itertools.count():
        try:
            return Channel.attach(name, index)
        except ReaderSlotBusy:
            continue
        except ReaderIndexError:
            raise InvalidArgument(
                f"every reader of relay channel {name!r} is taken ({index}): start `shmstore "
                f"relay connect` on this node with --readers {n_local} (its workers)",
                "readers", index) from None
        except (BadMagic, SegmentTooSmall) as exc:
            if not being_made(exc.name):
                raise
            raise SegmentNotFound(f"relay channel {name!r} is still being created ({exc.name!r} "
                                  "is not complete yet); try again in a moment", name) from None
        except SegmentNotFound:
            raise SegmentNotFound(
                f"no relay channel {name!r} on this node: start `shmstore relay connect "
                f"tcp://HEAD:PORT --name {name} --readers {n_local}` here before the engine, "
                f"and have the engine read {name} (vLLM: "
                f"VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME={name})", name) from None
    raise AssertionError("unreachable")

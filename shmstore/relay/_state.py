"""What a Publisher knows of each node, and the snapshots it gives out (relay/_publisher.py)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ._peer import MAX_HELD_IDS

__all__ = ["NodeStats", "PublisherStats"]


@dataclass(frozen=True, slots=True)
class NodeStats:
    """One connected node as the Publisher sees it."""

    name: str
    acked: int  # messages through this number are acknowledged
    unacked: int  # messages sent and not yet acknowledged
    held: int  # objects the Publisher believes the node holds
    objects_sent: int  # bodies sent (OBJECT)
    refs_sent: int  # REFs sent instead of a body
    bytes_sent: int  # every frame to this node, headers included


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """A snapshot of a Publisher."""

    endpoint: str
    messages: int  # messages read from the channel
    nodes: tuple[NodeStats, ...]
    nodes_joined: int  # nodes that joined while none of their identity was connected
    nodes_dropped: int  # silent for peer_timeout_s, too slow for ZeroMQ's queue, or gone
    needs_served: int  # bodies sent again on a NEED
    lost: int  # messages sent as LOST: cleared or damaged before they could be read
    bad_messages: int  # dropped: not of this protocol, or a NEED for nothing it waits for
    bytes_sent: int
    nodes_refused: int = 0  # HELLOs turned away: max_nodes were connected


@dataclass
class NodeState:
    """One connected node: what it acknowledged, holds and was sent (the Publisher's own)."""

    rid: bytes
    name: str
    acked: int
    last_heard: float
    identity: tuple[str, str | bytes] = ("name", "")  # its public key, or (plain) its name
    since: int = 0  # its HELLO's connection time: the newest connection of a node stays
    last_progress: float = 0.0  # when it last acknowledged something, or was caught up
    answered: set[int] = field(default_factory=set)  # NEEDs answered while unacknowledged
    held: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    objects_sent: int = 0
    refs_sent: int = 0
    bytes_sent: int = 0

    def hold(self, object_id: bytes) -> None:
        self.held[object_id] = None
        if len(self.held) > MAX_HELD_IDS:
            self.held.popitem(last=False)

"""A writer's Channel published to other nodes over ZeroMQ: one relay per node writes into
that node's own store and re-broadcasts the handles locally.

    _node.py       Relay (a node's side), the protocol and its scenarios
    _publisher.py  Publisher (the writer's side)
    _state.py      what a Publisher knows of each node, and its stats snapshots
    _peer.py       CurveZMQ keys, endpoint checks, the socket thread both sides share
    _wire.py       the frames and their checked parser

May import: errors, handle, _proc, shm, serde, store, queue.
"""

from ._node import NodeChannel, Relay, RelayStats
from ._peer import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_PEER_TIMEOUT_S,
    DEFAULT_WINDOW,
    CurveKeys,
    PublisherSecurity,
    RelaySecurity,
    Timing,
    check_endpoint,
    generate_keys,
)
from ._publisher import NodeStats, Publisher, PublisherStats

__all__ = ["Publisher", "Relay", "CurveKeys", "PublisherSecurity", "RelaySecurity", "Timing",
           "NodeChannel", "PublisherStats", "NodeStats", "RelayStats",
           "generate_keys", "check_endpoint", "DEFAULT_WINDOW", "DEFAULT_PEER_TIMEOUT_S",
           "DEFAULT_HEARTBEAT_S"]

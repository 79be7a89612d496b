"""`shmstore relay serve|connect|keygen`: the relay's command line (relay/_node.py does the work).

Kept apart from relay/_node.py so that building the CLI parser does not import ZeroMQ.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ._units import parse_size

    commands = parser.add_subparsers(dest="relay_command", required=True)
    serve = commands.add_parser("serve", help="on the writer's node: forward a channel to relays")
    serve.add_argument("channel", help="the writer's channel name")
    serve.add_argument("--reader", type=int, required=True,
                       help="the channel's reader index this publisher uses (the writer creates "
                            "the channel with one reader more than its local ones)")
    serve.add_argument("--bind", required=True,
                       help="address to listen on, e.g. tcp://10.0.0.1:5555 (one interface)")
    serve.add_argument("--allow-wildcard", action="store_true",
                       help="allow binding every interface (tcp://*:PORT, 0.0.0.0)")
    serve.add_argument("--keys", metavar="SECRET_FILE",
                       help="this publisher's CurveZMQ key pair (NAME.key_secret)")
    serve.add_argument("--allow", metavar="PUBLIC_FILE", action="append", default=None,
                       help="a relay's public key file (NAME.key) allowed to connect; repeat")
    serve.add_argument("--window", type=int, default=None,
                       help="messages a node may leave unacknowledged (default 64)")
    connect = commands.add_parser("connect", help="on another node: feed local readers")
    connect.add_argument("endpoint", help="the publisher's address, e.g. tcp://10.0.0.1:5555")
    connect.add_argument("--name", required=True, help="the node's local channel name")
    connect.add_argument("--readers", type=int, required=True, help="local readers")
    connect.add_argument("--capacity", type=parse_size, default=1 << 30,
                         help="bytes of the node's store (e.g. 4G; default 1G)")
    connect.add_argument("--keys", metavar="SECRET_FILE",
                         help="this relay's CurveZMQ key pair (NAME.key_secret)")
    connect.add_argument("--server-key", metavar="PUBLIC_FILE",
                         help="the publisher's public key file (NAME.key)")
    connect.add_argument("--no-wait", action="store_true",
                         help="connect before the local readers attached (they miss what came "
                              "before they did)")
    connect.add_argument("--writer-timeout", type=float, default=None, metavar="SECONDS",
                         help="report WriterGone to local readers after this long without a "
                              "word from the publisher (default: keep reconnecting)")
    for sub in (serve, connect):
        sub.add_argument("--peer-timeout", type=float, default=None, metavar="SECONDS",
                         help="silence after which the other side counts as gone (default 3)")
        sub.add_argument("--heartbeat", type=float, default=None, metavar="SECONDS",
                         help="PING interval (default 0.5)")
        sub.add_argument("--insecure", action="store_true",
                         help="plain TCP without CurveZMQ keys: anyone who reaches the port can "
                              "join (or pose as the publisher); only on a trusted network")
    keygen = commands.add_parser("keygen", help="write a CurveZMQ key pair")
    keygen.add_argument("directory")
    keygen.add_argument("name")


def _stop_on_signals(peer: Any) -> None:
    def handler(signum: int, frame: Any) -> None:
        peer.stop()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


def _given(value: Any, default: Any) -> Any:
    """An option's value if it was given (0 included: the API refuses it, naming it)."""
    return default if value is None else value


def _timing(args: argparse.Namespace, writer_timeout_s: float | None = None) -> Any:
    """The relay.Timing the options ask for (the defaults where not given)."""
    from ..relay import DEFAULT_HEARTBEAT_S, DEFAULT_PEER_TIMEOUT_S, Timing

    return Timing(peer_timeout_s=_given(args.peer_timeout, DEFAULT_PEER_TIMEOUT_S),
                  heartbeat_s=_given(args.heartbeat, DEFAULT_HEARTBEAT_S),
                  writer_timeout_s=writer_timeout_s)


def main(args: argparse.Namespace) -> int:
    from ..errors import ShmStoreError
    from ..relay import (
        DEFAULT_WINDOW,
        CurveKeys,
        NodeChannel,
        Publisher,
        PublisherSecurity,
        Relay,
        RelaySecurity,
        generate_keys,
    )

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        if args.relay_command == "keygen":
            public, secret = generate_keys(args.directory, args.name)
            print(f"public key (give to the peer): {public}\nsecret key (keep): {secret}")
            return 0
        if args.relay_command == "serve":
            keys = CurveKeys.load(args.keys) if args.keys else None
            allowed = (tuple(CurveKeys.load(path).public for path in args.allow)
                       if args.allow else None)
            security = PublisherSecurity(keys, allowed, plaintext=args.insecure)
            with Publisher(args.channel, args.reader, args.bind, security=security,
                           timing=_timing(args), allow_wildcard=args.allow_wildcard,
                           window=_given(args.window, DEFAULT_WINDOW)) as publisher:
                _stop_on_signals(publisher)
                print(f"publishing channel {args.channel!r} on {publisher.endpoint}", flush=True)
                why = publisher.serve()
            print(f"publisher stopped: {why}", flush=True)
            return 0
        keys = CurveKeys.load(args.keys) if args.keys else None
        server = CurveKeys.load(args.server_key).public if args.server_key else None
        with Relay(args.endpoint, args.name, n_readers=args.readers,
                   security=RelaySecurity(keys, server, plaintext=args.insecure),
                   timing=_timing(args, writer_timeout_s=args.writer_timeout),
                   channel=NodeChannel(capacity_bytes=args.capacity)) as relay:
            _stop_on_signals(relay)
            if not args.no_wait:
                print(f"channel {relay.name!r}: waiting for {args.readers} local reader(s)",
                      flush=True)
                relay.wait_for_readers()
            print(f"relaying {args.endpoint} into channel {relay.name!r}", flush=True)
            why = relay.serve()
            s = relay.stats()
        print(f"relay stopped: {why}; messages {s.messages}, objects received "
              f"{s.objects_received}, refs hit {s.refs_hit}, needs {s.needs}, lost {s.lost}",
              flush=True)
        return 0
    except ShmStoreError as exc:
        print(f"shmstore relay: {exc}", file=sys.stderr)
        return 2

"""One miss pool per node (serving/_pool_share.py): other processes submit through the pool's
host, a key in flight anywhere is processed once, and a missing host, a host that goes away or
a peer speaking the protocol badly never leaves a miss waiting."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import pytest

from shmstore.errors import InvalidArgument
from shmstore.serving import _pool_share as share
from shmstore.serving._outcome import STORED, Processor
from shmstore.serving._pool import MissPool
from shmstore.serving._pool_share import PoolClient, PoolHost, pool_address
from tests._waiting import wait_for
from tests.serving.test_pool import READY_S, STORES, TOY, hosted, started

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def serve(name: str, writer: Any, gate: str = "", workers: int = 1) -> tuple[MissPool, PoolHost]:
    pool = MissPool(STORES[name], Processor(TOY, (gate,)), workers=workers)
    wait_for(lambda: pool.stats().ready == workers, READY_S, "the pool's workers")
    return pool, PoolHost(pool, name, writer.epoch)


@contextmanager
def served(name: str, gate: str = "") -> Iterator[tuple[Any, MissPool, PoolHost, PoolClient]]:
    """A store, its pool served on the node, and one client of it; all closed after (a gate
    opened first, so that no held job outlives the test)."""
    with hosted(name) as writer:
        pool, host = serve(name, writer, gate)
        client = PoolClient(name)
        try:
            yield writer, pool, host, client
        finally:
            client.close()
            if gate:
                open(os.path.join(gate, "open"), "w").close()
            host.close()
            pool.close()


def test_a_key_in_flight_on_the_node_is_processed_once_whoever_sent_it(
        name: str, tmp_path: Any) -> None:
    gate = str(tmp_path)
    with hosted(name) as writer:
        pool, host = serve(name, writer, gate)
        clients = [PoolClient(name), PoolClient(name)]  # two other API servers
        try:
            mine = pool.submit("photo", {"bytes": b"p" * 64, "hold": True})
            wait_for(lambda: len(started(gate)) == 1, READY_S, "the first job")
            theirs = [c.submit("photo", {"bytes": b"p" * 64, "hold": True}) for c in clients]
            wait_for(lambda: pool.stats().waited == 2, READY_S, "the clients' jobs to arrive")
            open(os.path.join(gate, "open"), "w").close()
            assert [f.result(READY_S) for f in (mine, *theirs)] == [STORED] * 3
            assert len(started(gate)) == 1 and pool.stats().submitted == 1
            assert [c.waited for c in clients] == [1, 1]
            assert writer.cached(["photo"]) == [True]
            # a new key from a client: processed, answered
            assert clients[0].submit("other", {"bytes": b"o"}).result(READY_S) == STORED
            assert clients[1].submit("bad", {"bytes": b"", "fail": "x"}).result(READY_S) \
                == "failed"
        finally:
            for c in clients:
                c.close()
            host.close()
            pool.close()


def test_no_host_answers_unavailable_at_once_then_the_client_connects(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(share, "RETRY_S", 0.0)
    with hosted(name) as writer:
        client = PoolClient(name)
        try:
            assert client.submit("k", {"bytes": b"k"}).result(timeout=0) == "unavailable"
            pool, host = serve(name, writer)
            try:
                assert client.submit("k", {"bytes": b"k"}).result(READY_S) == STORED
                held = client.submit("slow", {"bytes": b"s", "die": True})
                assert held.result(READY_S) == "died"  # the pool's worker died: a fallback
            finally:
                host.close()
                pool.close()
            # the host is gone: the connection drops, new jobs are unavailable at once
            wait_for(lambda: client.submit("z", {"bytes": b"z"}).done(), READY_S,
                     "a submit answered at once")
            assert client.submit("z", {"bytes": b"z"}).result(timeout=0) == "unavailable"
        finally:
            client.close()
        assert client.submit("after", {"bytes": b"a"}).result(timeout=0) == "closed"


def test_a_host_closed_with_jobs_in_flight_answers_them_unavailable(
        name: str, tmp_path: Any) -> None:
    gate = str(tmp_path)
    with served(name, gate) as (_, _, host, client):
        held = client.submit("held", {"bytes": b"h", "hold": True})
        wait_for(lambda: len(started(gate)) == 1, READY_S, "the job")
        host.close()
        assert held.result(READY_S) == "unavailable"


def test_more_jobs_in_flight_than_a_connection_may_have_are_answered_full(
        name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(share, "MAX_PENDING", 1)
    gate = str(tmp_path)
    with served(name, gate) as (_, _, _, client):
        first = client.submit("a", {"bytes": b"a", "hold": True})
        assert client.submit("b", {"bytes": b"b"}).result(READY_S) == "full"
        open(os.path.join(gate, "open"), "w").close()
        assert first.result(READY_S) == STORED


def _raw(name: str, epoch: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(pool_address(name, epoch))
    sock.settimeout(30)
    return sock


def _frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("<I", len(body)) + body


@pytest.mark.parametrize("frame", [
    struct.pack("<I", 0),
    struct.pack("<I", share.MAX_JOB_BYTES + 1),
    struct.pack("<I", 3) + b"\xc1\xc1\xc1",
    _frame(7),
    _frame(["1", "key", {}]),
    _frame([1, "", {}]),
    _frame([1, "k" * 1025, {}]),
    _frame([1, "key"]),
])
def test_a_hostile_frame_drops_that_connection_only(name: str, frame: bytes) -> None:
    with served(name) as (writer, _, _, client):
        sock = _raw(name, writer.epoch)
        sock.sendall(frame)
        assert sock.recv(1 << 16) == b""  # dropped
        sock.close()
        assert client.submit("after", {"bytes": b"a"}).result(READY_S) == STORED


def test_a_second_host_of_one_store_is_refused(name: str) -> None:
    with hosted(name) as writer:
        pool, host = serve(name, writer)
        try:
            with pytest.raises(Exception, match="socket name is taken"):
                PoolHost(pool, name, writer.epoch)
        finally:
            host.close()
            pool.close()


def test_the_pools_name_cannot_be_derived_from_the_writer_hosts_and_taken_first(
        name: str) -> None:
    """Every user can list abstract socket names (/proc/net/unix): the writer host's is seen the
    moment it binds. Another user who turns it into the pool's (as the names were once made:
    one digest, another prefix) and binds that first must not keep the pool from its host."""
    with hosted(name) as writer:
        from shmstore.store._host import host_address
        seen = host_address(name, writer.epoch)
        squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        squatter.bind(seen.replace("shmstore.writer.", "shmstore.pool.", 1))
        squatter.listen(1)
        try:
            assert seen.rsplit(".", 1)[1] not in pool_address(name, writer.epoch)
            pool, host = serve(name, writer)
            client = PoolClient(name)
            try:
                assert client.submit("a", {"bytes": b"a"}).result(READY_S) == STORED
            finally:
                client.close()
                host.close()
                pool.close()
        finally:
            squatter.close()


def test_a_job_with_int_map_keys_is_refused_by_the_client_and_the_connection_stays(
        name: str, tmp_path: Any) -> None:
    """Such a job once reached the host, whose decoder dropped the whole connection: the API
    server's other jobs in flight then fell back. Now the client refuses it before sending."""
    gate = str(tmp_path)
    with served(name, gate) as (_, _, _, client):
        held = client.submit("held", {"bytes": b"h", "hold": True})
        wait_for(lambda: len(started(gate)) == 1, READY_S, "the held job")
        with pytest.raises(InvalidArgument, match="map keys must be str"):
            client.submit("bad", {"bytes": b"b", "kwargs": {7: "seven"}})
        open(os.path.join(gate, "open"), "w").close()
        assert held.result(READY_S) == STORED
        assert client.submit("next", {"bytes": b"n"}).result(READY_S) == STORED

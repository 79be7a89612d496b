"""The vLLM plugin where vLLM turns IPC caching off: several API servers and data-parallel
engines on one node sharing one store (API server 0 writes it, the others through its
WriterHost). vLLM's real item and cache classes; a stand-in configuration (see
test_vllm_plugin.py). Two API servers and two engines of one worker each live in this process;
the real `vllm serve` runs are in test_vllm_serve_shapes.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.multimodal.cache import factories  # noqa: E402

from shmstore.store._remote import RemoteWriter  # noqa: E402
from shmstore.vllm import _install  # noqa: E402
from shmstore.vllm._items import handout_from_item, handout_number  # noqa: E402
from shmstore.vllm._receiver import ShmstoreReceiverCache  # noqa: E402
from shmstore.vllm._sender import ShmstoreSenderCache  # noqa: E402
from tests._waiting import wait_for  # noqa: E402
from tests.vllm.test_vllm_plugin import config, image_item, over_the_wire, same_item  # noqa: E402

MB = 1 << 20


@pytest.fixture(autouse=True)
def segment_name(name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", name)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return name


@pytest.fixture
def node(name: str) -> Any:
    """Two API servers and two DP engines of one worker each (readers 0 and 1)."""
    senders = [ShmstoreSenderCache(config(name, cache_mb=cache_mb(), world_size=1,
                                          api_servers=2, api_rank=r, dp=2))
               for r in range(2)]
    receivers = [ShmstoreReceiverCache(config(name, world_size=1, dp_index=e), None)
                 for e in range(2)]
    for e, receiver in enumerate(receivers):
        assert receiver.reader.reader == e  # engine e's worker is reader e
    yield senders, receivers
    for r in receivers:
        r.close()
    for s in reversed(senders):  # the clients first, then the writer
        s.close()


def cache_mb() -> float:
    return 6 * 1.4  # about five of these images


def read(receiver: ShmstoreReceiverCache, request: str, out: Any, mm_hash: str) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    feature = MultiModalFeatureSpec(data=over_the_wire(out), modality="image",
                                    identifier=mm_hash, mm_position=PlaceholderRange(0, 4),
                                    mm_hash=mm_hash)
    return receiver.features_of_request(request, [feature])[0].data


def store_and_read(server: ShmstoreSenderCache, receivers: list[ShmstoreReceiverCache],
                   i: int) -> None:
    """A new image through `server`, read by every engine's worker (request n{i})."""
    out, _ = server.get_and_update_item((image_item(100 + i), []), f"k{i}")
    for receiver in receivers:
        read(receiver, f"n{i}", out, f"k{i}")


def test_api_server_1_writes_through_api_server_0(node: Any) -> None:
    (first, second), _ = node
    assert isinstance(second.store, RemoteWriter) and not isinstance(first.store, RemoteWriter)
    assert second.store.n_readers == first.store.n_readers == 2


def test_an_image_stored_by_one_api_server_is_a_hit_for_the_other(node: Any) -> None:
    (first, second), receivers = node
    out, _ = second.get_and_update_item((image_item(1), ["updates"]), "h1")  # stored by 1
    # API server 0 has no prompt updates for it: vLLM processes it there, and the store
    # hands out the copy API server 1 made
    assert not first.is_cached_item("h1")
    again, updates = first.get_and_update_item((image_item(1), ["updates"]), "h1")
    assert updates == ["updates"] and handout_from_item(again).handle == handout_from_item(out).handle
    assert first.store.stats().puts == 1  # one copy on the node
    assert (first.items["shared"], second.items["stored"]) == (1, 1)
    assert first.is_cached_item("h1")  # from now on a hit there too
    hit, _ = first.get_and_update_item(None, "h1")
    assert first.items["hit"] == 1
    for n, item in enumerate((out, again, hit)):
        for receiver in receivers:
            assert same_item(read(receiver, f"r{n}", item, "h1"), image_item(1))
    assert first.store.unread(handout_from_item(out).handle) == (0, 0)


def test_a_hand_out_is_owed_only_by_the_engine_its_request_went_to(node: Any) -> None:
    (first, second), receivers = node
    outs = {}
    for server, engine, mm_hash in ((first, 0, "a"), (second, 1, "b"), (second, 0, "c")):
        out, _ = server.get_and_update_item((image_item(ord(mm_hash)), []), mm_hash)
        server.ledger.request_added(f"req-{mm_hash}", [handout_number(out)])
        server.routed(f"req-{mm_hash}", engine)  # the DP client's choice
        outs[mm_hash] = (out, engine)
    for mm_hash, (out, engine) in outs.items():
        owed = [0, 0]
        owed[engine] = 1
        # API server 1's narrow is posted (no reply on the routing path): wait for it to land
        handle, want = handout_from_item(out).handle, tuple(owed)
        wait_for(lambda h=handle, w=want: first.store.unread(h) == w, 30,
                 f"the narrow of {mm_hash!r} to engine {engine}")
        read(receivers[engine], f"req-{mm_hash}", out, mm_hash)
        assert first.store.unread(handout_from_item(out).handle) == (0, 0)


def test_a_request_refused_at_api_server_1_gives_back_through_the_host(node: Any) -> None:
    (first, second), _ = node
    out, _ = second.get_and_update_item((image_item(5), []), "h5")
    second.ledger.refused([handout_number(out)])
    assert first.store.unread(handout_from_item(out).handle) == (0, 0)
    assert second.ledger.settled["refused"] == 1


def test_one_servers_ended_hand_outs_never_withdraw_what_the_others_live_request_holds(
        node: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (first, second), receivers = node
    for sender in (first, second):  # settle at once
        monkeypatch.setattr(sender.ledger, "_settle_s", 0.0)
    out, _ = second.get_and_update_item((image_item(7), []), "held")
    second.ledger.request_added("gone", [handout_number(out)])
    second.ledger.request_ended("gone", aborted=True)  # never read
    live, _ = first.get_and_update_item((image_item(7), []), "held")  # shared, live request
    first.ledger.request_added("alive", [handout_number(live)])
    for i in range(8):  # more than the store holds: both servers' misses go round the ring
        store_and_read((first, second)[i % 2], receivers, i)
    assert first.store.is_cached("held")  # API server 0's live request still holds it
    assert first.items["inline"] + second.items["inline"] > 0  # so the ring stays full
    for receiver in receivers:
        assert same_item(read(receiver, "alive", live, "held"), image_item(7))
    first.ledger.request_ended("alive", aborted=False)
    inline_before = first.items["inline"] + second.items["inline"]
    for i in range(8, 14):  # now nothing is owed by a live request: never inline again
        store_and_read((first, second)[i % 2], receivers, i)
    assert first.items["inline"] + second.items["inline"] == inline_before
    assert first.store.stats().withdrawn == 1 and second.ledger.settled["aborted"] == 1


@pytest.mark.parametrize(("shape", "served"), [
    ({"api_servers": 2, "api_rank": 1}, True),
    ({"dp": 2}, True),
    ({"dp": 4, "dp_local": 2, "hybrid_lb": True}, True),
    ({"dp": 4, "dp_local": 2}, False),  # engines on other nodes behind the internal LB
    ({"api_servers": 2, "nodes": 2, "world_size": 2}, False),  # with a TP group across nodes
])
def test_vllms_processor_only_fallback_is_lifted_where_one_store_serves(
        name: str, shape: dict[str, Any], served: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    _install.install()
    cfg = config(name, **shape)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.shmstore"):
        cache_type = factories._get_cache_type(cfg)
    if served:
        assert cache_type == "shm"
    else:
        assert cache_type == "processor_only" and "processor-only cache stays" in caplog.text
    cfg.model_config.get_multimodal_config().mm_processor_cache_type = "lru"
    assert factories._get_cache_type(cfg) == "processor_only"  # only shm is lifted


def test_the_layout_is_logged_once_per_api_server(name: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.plugins.shmstore"):
        sender = ShmstoreSenderCache(config(name, world_size=2, dp=2))
    try:
        assert ("layout: 1 API server(s) (this is 0, writes it), 2 engine(s) x 2 worker(s) = "
                "4 reader(s)") in caplog.text
    finally:
        sender.close()

"""Hand-outs that follow vLLM requests, against the real vllm package's item and feature
classes: refused, aborted, finished, never claimed, several samples, preempted and re-sent,
reset under traffic. The engine test (test_vllm_serve.py) runs the same through a real server."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.multimodal.cache.base import MultiModalCacheMissError
from vllm.multimodal.inputs import (
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PlaceholderRange,
)

from shmstore.handle import Handle, HandOut
from shmstore.serving._requests import numbers_in
from shmstore.vllm._env import LEASE_ENV, SETTLE_ENV
from shmstore.vllm._items import HANDLE_FIELD, handle_item, handout_number
from shmstore.vllm._receiver import ShmstoreReceiverCache
from shmstore.vllm._sender import ShmstoreSenderCache
from tests.vllm.test_vllm_plugin import config, image_item, over_the_wire, same_item

SETTLE_S = 0.3


@pytest.fixture(autouse=True)
def _short_times(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", name)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv(SETTLE_ENV, str(SETTLE_S))
    monkeypatch.setenv(LEASE_ENV, str(2 * SETTLE_S))


@pytest.fixture
def small(name: str) -> Any:
    """A store that holds four 1.3 MB items, one worker."""
    cfg = config(name, cache_mb=6, max_object_mb=6, world_size=1)
    sender = ShmstoreSenderCache(cfg)
    receiver = ShmstoreReceiverCache(cfg, None)
    receiver.reader  # noqa: B018  (attach now)
    yield sender, receiver
    receiver.close()
    sender.close()


def feature(item: Any, mm_hash: str) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=over_the_wire(item), modality="image", identifier=mm_hash,
                                 mm_position=PlaceholderRange(offset=3, length=10),
                                 mm_hash=mm_hash)


def send(sender: Any, receiver: Any, key: str, request: str) -> bool:
    """One request with one new image, read by the worker; True if it went by handle."""
    out, _ = sender.get_and_update_item((image_item(hash(key) % 1000), []), key)
    number = handout_number(out)
    if number is not None:
        sender.ledger.request_added(request, [number])
    receiver.features_of_request(request, [feature(out, key)])
    sender.ledger.request_ended(request, aborted=False)
    return number is not None


def wedge(sender: Any, key: str = "stuck") -> Any:
    """A hand-out that no worker reads (its request never reaches one)."""
    out, _ = sender.get_and_update_item((image_item(999), []), key)
    assert HANDLE_FIELD in out
    return out


def frozen_clock(sender: Any) -> list[float]:
    """The sender's ledger reads its time from the list returned (now[0]) from here on: the
    test moves time itself, and a slow machine between two steps moves nothing."""
    now = [time.monotonic()]
    sender.ledger._clock = lambda: now[0]
    return now


def test_a_refused_request_gives_its_hand_outs_back_at_once(small: Any) -> None:
    sender, receiver = small
    out = wedge(sender)
    prompt = {"type": "multimodal", "mm_kwargs": {"image": [out]}, "mm_hashes": {"image": ["x"]}}
    assert numbers_in(prompt, handout_number) == [handout_number(out)]
    sender.ledger.refused(numbers_in(prompt, handout_number))  # process_inputs raised
    assert sender.store.unread(sender.store.handle_of("stuck")) == (0,)
    assert all(send(sender, receiver, f"k{i}", f"r{i}") for i in range(12))  # never inline
    assert sender.ledger.settled["refused"] == 1 and sender.store.stats().withdrawn == 0


def test_a_request_the_engine_refuses_on_arrival_gives_its_hand_outs_back_as_refused(
        small: Any) -> None:
    """vLLM 0.33: a paused engine refuses a request it was sent; the output says so (its
    `error`) and vLLM ends it through _finish_request, as a finished one. Its hand-outs are
    given back at once and counted as refused; a finished request beside it is not."""
    from types import SimpleNamespace

    from shmstore.vllm import _hooks

    sender, receiver = small
    refused, done = wedge(sender, "refused"), wedge(sender, "done")
    sender.ledger.request_added("paused", [handout_number(refused)])
    sender.ledger.request_added("done", [handout_number(done)])
    receiver.features_of_request("done", [feature(done, "done")])
    finish = _hooks.wrappers()["finish_request"](lambda self, state: None)

    def process_outputs(self: Any, outputs: list[Any]) -> str:  # as vLLM ends them
        for out in outputs:
            finish(self, SimpleNamespace(request_id=out.request_id))
        return "processed"

    wrapped = _hooks.wrappers()["process_outputs"](process_outputs)
    outputs = [SimpleNamespace(request_id="paused", error=SimpleNamespace(code="paused")),
               SimpleNamespace(request_id="done", error=None)]
    assert wrapped(None, outputs) == "processed"
    assert sender.ledger.settled["refused"] == 1 and sender.ledger.live_requests == 0
    assert sender.store.unread(sender.store.handle_of("refused")) == (0,)  # given back now
    # nothing waits for a settle: the refused hand-out is gone from the ledger (no later
    # count as finished_unread), the finished one was read; the store never wedges
    assert all(send(sender, receiver, f"k{i}", f"r{i}") for i in range(12))  # never inline
    assert sender.ledger.settled["refused"] == 1 and sender.store.stats().withdrawn == 0
    assert sender.ledger.settled["finished_unread"] == 0


@pytest.mark.parametrize("claimed", [True, False])
def test_an_ended_or_unclaimed_hand_out_is_withdrawn_once_the_store_is_full(
        small: Any, claimed: bool) -> None:
    sender, receiver = small
    now = frozen_clock(sender)
    out = wedge(sender)
    if claimed:  # aborted while queued: the API process saw it end, no worker read it
        sender.ledger.request_added("gone", [handout_number(out)])
        sender.ledger.request_ended("gone", aborted=True)
    now[0] += 0.9 * SETTLE_S  # not yet settled, nor past the lease (2 * SETTLE_S)
    by_handle = [send(sender, receiver, f"k{i}", f"r{i}") for i in range(12)]
    assert by_handle[:3] == [True] * 3 and not any(by_handle[4:])  # wedged: inline
    now[0] += 1.2 * SETTLE_S if claimed else 2.2 * SETTLE_S  # past the settle / the lease
    assert all(send(sender, receiver, f"n{i}", f"s{i}") for i in range(12))  # unwedged
    reason = "aborted" if claimed else "lease"
    assert sender.ledger.settled[reason] == 1 and sender.store.stats().withdrawn == 1
    with pytest.raises(MultiModalCacheMissError):  # a read that still came fails loudly
        receiver.features_of_request("late", [feature(out, "stuck")])


def test_a_live_request_keeps_its_hand_out_however_long_it_waits(small: Any) -> None:
    sender, receiver = small
    out = wedge(sender)
    sender.ledger.request_added("queued", [handout_number(out)])
    time.sleep(3 * SETTLE_S)  # past the lease too: it is claimed, and the request is alive
    by_handle = [send(sender, receiver, f"k{i}", f"r{i}") for i in range(12)]
    assert by_handle[:3] == [True] * 3 and not any(by_handle[4:])  # it holds the ring
    got = receiver.features_of_request("queued", [feature(out, "stuck")])
    assert same_item(got[0].data, image_item(999))  # scheduled at last: its data is there
    sender.ledger.request_ended("queued", aborted=False)
    assert all(send(sender, receiver, f"n{i}", f"s{i}") for i in range(12))
    assert sender.store.stats().withdrawn == 0


def test_a_preempted_request_read_again_counts_once(small: Any) -> None:
    sender, receiver = small
    out, _ = sender.get_and_update_item((image_item(1), []), "img")
    hit, _ = sender.get_and_update_item(None, "img")  # a second request hits it
    for _ in range(3):  # the first request, sent to the worker again after each preemption
        receiver.features_of_request("first", [feature(out, "img")])
    handle = sender.store.handle_of("img")
    assert sender.store.unread(handle) == (1,)  # the second request's read is still owed
    receiver.features_of_request("second", [feature(hit, "img")])
    assert sender.store.unread(handle) == (0,)


def test_model_runner_v2_neither_frees_nor_replays_a_handle_item(small: Any) -> None:
    """vLLM 0.33's scheduler, with Model Runner V2, frees a worker's encoder inputs once they
    are computed and sends them again when a running request rewinds, except items with an
    "address" (shm descriptors). A handle item has one: the worker keeps the owned copy it read
    at install for the request's life, so a rewind re-encodes from it; a reinstall (resume)
    reads the hand-out again, counted once."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    updates_of = getattr(Scheduler, "_get_encoder_input_updates", None)
    if updates_of is None:
        pytest.skip("this vLLM's scheduler neither frees nor replays encoder inputs (0.33's does)")
    sender, receiver = small
    out, _ = sender.get_and_update_item((image_item(1), []), "img")
    plain = image_item(2)
    features = [MultiModalFeatureSpec(data=plain, modality="image", identifier="plain",
                                      mm_position=PlaceholderRange(offset=0, length=4),
                                      mm_hash="plain"), feature(out, "img")]
    request = SimpleNamespace(mm_features=features, num_computed_tokens=0,
                              num_output_placeholders=0, num_in_flight_tokens=0)
    scheduler = SimpleNamespace(use_v2_model_runner=True, _pending_encoder_input_ids={},
                                requests={"r": request}, is_encoder_decoder=False)
    installed = [SimpleNamespace(req_id="r", mm_features=features)]
    assert updates_of(scheduler, {"r": 16}, installed, {"r": [0, 1]}) == {}
    request.num_computed_tokens = 16  # both encoded: vLLM's data freed, the handle item kept
    assert updates_of(scheduler, {"r": 1}, [], {}) == {"r": {0: None}}
    request.num_computed_tokens = 0  # rewound: vLLM's data sent again, the handle item not
    assert updates_of(scheduler, {"r": 16}, [], {"r": [0, 1]}) == {"r": {0: plain}}
    for _ in range(2):  # reinstalled (resumed): read again, served, counted once
        got = receiver.features_of_request("r", [feature(out, "img")])
        assert same_item(got[0].data, image_item(1))
    assert sender.store.unread(sender.store.handle_of("img")) == (0,)


def test_samples_of_one_request_each_get_a_hand_out(small: Any) -> None:
    sender, receiver = small
    out, _ = sender.get_and_update_item((image_item(2), []), "img")
    number = handout_number(out)
    assert sender.ledger.request_added("req-0", [number]) == []
    renumbered = sender.ledger.request_added("req-1", [number])  # n = 2: the same item again
    assert len(renumbered) == 1 and renumbered[0][0] == number
    handle = sender.store.handle_of("img")
    assert sender.store.unread(handle) == (2,)
    receiver.features_of_request("req-0", [feature(out, "img")])
    assert sender.store.unread(handle) == (1,)  # owed to the second sample, not over-read
    receiver.features_of_request("req-1", [feature(out, "img")])
    assert sender.store.unread(handle) == (0,)


def test_a_handle_under_another_items_hash_is_a_miss(small: Any) -> None:
    sender, receiver = small
    out, _ = sender.get_and_update_item((image_item(3), []), "mine")
    with pytest.raises(MultiModalCacheMissError) as info:
        receiver.features_of_request("r", [feature(out, "theirs")])
    assert info.value.mm_hashes == ["theirs"]
    assert sender.store.unread(sender.store.handle_of("mine")) == (1,)  # nothing was counted


def test_reset_under_traffic_serves_requests_in_flight_and_empties_the_cache(small: Any) -> None:
    sender, receiver = small
    inflight = [sender.get_and_update_item((image_item(10 + i), []), f"f{i}")[0] for i in range(3)]
    for i, out in enumerate(inflight):
        sender.ledger.request_added(f"q{i}", [handout_number(out)])
    sender.clear_cache()  # reset_mm_cache while three requests wait to be scheduled
    assert not any(sender.is_cached_item(f"f{i}") for i in range(3))
    for i in range(6):  # new requests meanwhile: misses stored again, the old ones kept
        send(sender, receiver, f"f{i}", f"new{i}")
    for i, out in enumerate(inflight):  # the requests in flight read their own bytes
        got = receiver.features_of_request(f"q{i}", [feature(out, f"f{i}")])
        assert same_item(got[0].data, image_item(10 + i))
        sender.ledger.request_ended(f"q{i}", aborted=False)
    assert all(send(sender, receiver, f"n{i}", f"s{i}") for i in range(12))
    assert sender.store.stats().withdrawn == 0


def test_settled_hand_outs_are_exported_by_reason(small: Any) -> None:
    from prometheus_client import generate_latest

    sender, receiver = small
    sender.ledger.refused([handout_number(wedge(sender))])
    segment = sender.store.name
    text = generate_latest().decode()
    assert f'shmstore_vllm_settled_total{{api_server="0",reason="refused",segment="{segment}"}} 1.0' in text
    assert f'shmstore_vllm_settled_total{{api_server="0",reason="aborted",segment="{segment}"}} 0.0' in text
    assert f'shmstore_withdrawn_total{{segment="{segment}"}} 0.0' in text


def test_malformed_hand_out_numbers_are_not_numbers() -> None:
    assert handout_number(None) is None and handout_number("x") is None
    junk = MultiModalKwargsItem({HANDLE_FIELD: MultiModalFieldElem(
        data=[1, 2], field=image_item(0)["pixel_values"].field)})
    assert handout_number(junk) is None
    assert numbers_in({"a": [{"b": ["c"]}]}, handout_number) == []


@pytest.mark.parametrize("hook", ["add_request", "finish_request", "abort_requests",
                                  "engine_for_request", "process_outputs"])
def test_a_ledger_that_fails_after_vllm_acted_never_raises_into_vllm(hook: str, caplog) -> None:
    """API server 0 (the store's writer) gone: telling the ledger fails, but vLLM's method has
    run already; the request must not be stranded by an exception from the hook."""
    from types import SimpleNamespace

    from shmstore.errors import Closed
    from shmstore.vllm import _hooks

    class Gone:
        def __getattr__(self, name: str) -> Any:
            def fail(*args: Any, **kwargs: Any) -> None:
                raise Closed("the host of store 'x' went away")
            return fail

    handle = Handle(128, 1, b"d" * 16, 7)
    request = SimpleNamespace(request_id="r1", mm_features=[
        SimpleNamespace(data=handle_item(HandOut(handle, 5, b"i" * 24)))])
    fake = SimpleNamespace(ledger=Gone(), routed=Gone().routed)
    calls = {"add_request": ((None, request), "added"),
             "finish_request": ((None, request), "finished"),
             "abort_requests": ((None,), ["r1"]),
             "engine_for_request": ((None, request), b"\x01\x00"),
             "process_outputs": ((None, [SimpleNamespace(request_id="r1", error="paused")]),
                                 "processed")}
    args, result = calls[hook]
    wrapped = _hooks.wrappers()[hook](lambda *a, **k: result)
    _hooks.SENDERS.append(fake)
    try:
        assert wrapped(*args) == result
    finally:
        _hooks.SENDERS.remove(fake)
    assert "could not record" in caplog.text

"""The vLLM plugin against the real vllm package: vLLM's own item, feature, serializer and cache
classes. The configuration is a stand-in with the fields the caches read (a real VllmConfig
needs a model; the end-to-end engine test builds one)."""

from __future__ import annotations

import fcntl
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import posix_ipc
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.multimodal.cache import factories  # noqa: E402
from vllm.multimodal.cache.base import (  # noqa: E402
    BaseMultiModalProcessorCache,
    BaseMultiModalReceiverCache,
    MultiModalCacheMissError,
)
from vllm.multimodal.inputs import (  # noqa: E402
    MultiModalFeatureSpec,
    MultiModalFieldConfig,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PlaceholderRange,
)
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from shmstore.handle import HANDOUT_WORDS  # noqa: E402
from shmstore.relay import (  # noqa: E402
    CurveKeys,
    NodeChannel,
    Relay,
    RelaySecurity,
    Timing,
    generate_keys,
)
from shmstore.serving._nodes import NodeFeed  # noqa: E402
from shmstore.vllm._env import (  # noqa: E402
    ALLOW_ENV,
    INSECURE_ENV,
    KEYS_ENV,
    LOG_NAME,
    PUBLISH_ENV,
    WAIT_ENV,
)
from shmstore.vllm._install import _remove_if_orphaned  # noqa: E402
from shmstore.vllm._items import HANDLE_FIELD, handout_from_item  # noqa: E402
from shmstore.vllm._receiver import ShmstoreReceiverCache  # noqa: E402
from shmstore.vllm._sender import ShmstoreSenderCache  # noqa: E402
from tests._names import Channel, Closed, InvalidArgument, ObjectStore, SegmentNotFound  # noqa: E402
from tests._waiting import wait_for  # noqa: E402
from tests.workers import fake_relay_main  # noqa: E402

MB = 1 << 20
SPAWN = mp.get_context("spawn")


@pytest.fixture(autouse=True)
def segment_name(name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every cache of a test uses the test's segment name (restored afterwards)."""
    monkeypatch.setenv("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", name)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return name


def config(name: str, cache_mb: float = 64, max_object_mb: int = 32, world_size: int = 2,
           cache_type: str = "shm", nodes: int = 1, node_rank: int = 0, api_servers: int = 1,
           api_rank: int = 0, dp: int = 1, dp_local: int | None = None, dp_index: int = 0,
           hybrid_lb: bool = False) -> Any:
    """The fields of a VllmConfig the caches read; the segment name comes from the
    environment, as in vLLM (`name` only documents which one the test means)."""
    mm = SimpleNamespace(mm_processor_cache_gb=cache_mb / 1024, mm_shm_cache_max_object_size_mb=max_object_mb,
                         mm_processor_cache_type=cache_type)
    model = SimpleNamespace(get_multimodal_config=lambda: mm, supports_multimodal_inputs=True)
    parallel = SimpleNamespace(world_size=world_size, _api_process_count=api_servers,
                               _api_process_rank=api_rank, data_parallel_size=dp,
                               data_parallel_size_local=dp if dp_local is None else dp_local,
                               data_parallel_index=dp_index, data_parallel_hybrid_lb=hybrid_lb,
                               data_parallel_external_lb=False, nnodes_within_dp=nodes,
                               node_rank_within_dp=node_rank,
                               local_world_size=world_size // nodes)
    return SimpleNamespace(model_config=model, parallel_config=parallel)


def image_item(seed: int, nbytes: float = 1.3 * MB) -> MultiModalKwargsItem:
    """One LLaVA-style image item: pixel_values (batched) and image_sizes, a flat field too."""
    side = int((nbytes / 12) ** 0.5)
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(1, 3, side, side, generator=g)
    batched = MultiModalFieldConfig.batched("image").field
    flat = MultiModalFieldConfig.flat("image", [slice(0, 2)], dim=0).field
    return MultiModalKwargsItem({
        "pixel_values": MultiModalFieldElem(data=pixels[0], field=batched),
        "image_sizes": MultiModalFieldElem(data=torch.tensor([side, side]), field=batched),
        "grid": MultiModalFieldElem(data=torch.arange(2, dtype=torch.bfloat16), field=flat),
    })


def same_item(a: MultiModalKwargsItem, b: MultiModalKwargsItem) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if type(x.field) is not type(y.field) or x.field != y.field:
            return False
        if not (x.data.dtype == y.data.dtype and torch.equal(x.data, y.data)):
            return False
    return True


def over_the_wire(item: Any) -> Any:
    """What vLLM does to an item between the API process and the workers."""
    return MsgpackDecoder(MultiModalKwargsItem).decode(MsgpackEncoder().encode(item))


@pytest.fixture
def caches(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    cfg = config(name)
    sender = ShmstoreSenderCache(cfg)
    receivers = []
    for rank in range(2):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        receivers.append(ShmstoreReceiverCache(cfg, None))
        assert receivers[-1].reader.reader == rank  # attach now, as rank `rank`
    yield sender, receivers
    for r in receivers:
        r.close()
    sender.close()


def test_they_are_vllms_cache_types_with_vllms_constructors(caches: Any) -> None:
    sender, receivers = caches
    assert isinstance(sender, BaseMultiModalProcessorCache)
    assert all(isinstance(r, BaseMultiModalReceiverCache) for r in receivers)


def test_a_miss_is_stored_once_and_every_worker_reads_it(caches: Any) -> None:
    sender, receivers = caches
    item = image_item(1)
    out, updates = sender.get_and_update_item((item, ["u1"]), "h1")
    assert updates == ["u1"] and HANDLE_FIELD in out and "address" in out
    assert sender.store.stats().puts == 1
    for r in receivers:
        assert same_item(r.get_and_update_item(over_the_wire(out), "h1"), item)
    assert sender.store.stats().reader_lag == (0, 0)


def test_a_hit_sends_a_handle_without_the_processor_and_counts(caches: Any) -> None:
    sender, receivers = caches
    item = image_item(2)
    for out in (sender.get_and_update_item((item, ["u2"]), "h2")[0],
                sender.get_and_update_item(None, "h2")[0]):
        for r in receivers:
            r.get_and_update_item(over_the_wire(out), "h2")
    before = sender.store.stats().hits
    assert sender.is_cached(["h2", "nope", "h2"]) == [True, False, True]
    assert sender.is_cached(["h2"]) == [True]  # asked again: still the one hand-out
    assert sender.store.stats().hits == before + 1  # is_cached took the hit's hand-out
    sender.touch_sender_cache_item("h2")  # and the touch finds it
    assert sender.store.stats().hits == before + 1
    out, updates = sender.get_and_update_item(None, "h2")  # the processor did not run
    assert updates == ["u2"]  # P0 kept them
    for r in receivers:
        assert same_item(r.get_and_update_item(over_the_wire(out), "h2"), item)
    info = sender.make_stats(delta=True)
    assert (info.hits, info.total) == (2, 3)
    assert (sender.make_stats(delta=True).hits, sender.make_stats().total) == (0, 3)


@pytest.fixture
def one_worker(name: str) -> Iterator[tuple[Any, Any, Callable[[str], None]]]:
    """A sender with a 6 MB store and its one worker; send(h) stores image h, the worker reads
    it."""
    cfg = config(name, cache_mb=6, max_object_mb=6, world_size=1)
    sender = ShmstoreSenderCache(cfg)
    receiver = ShmstoreReceiverCache(cfg, None)

    def send(h: str) -> None:
        out, _ = sender.get_and_update_item((image_item(hash(h) % 100), []), h)
        receiver.get_and_update_item(over_the_wire(out), h)

    yield sender, receiver, send
    receiver.close()
    sender.close()


def test_touched_items_survive_eviction_until_released(one_worker: Any) -> None:
    sender, receiver, send = one_worker
    send("a")
    sender.touch_sender_cache_item("a")
    for i in range(8):  # several times the store: everything else is evicted meanwhile
        send(f"x{i}")
    assert sender.is_cached_item("a")
    out, _ = sender.get_and_update_item(None, "a")  # uses the touch
    receiver.get_and_update_item(over_the_wire(out), "a")
    sender.touch_sender_cache_item("x7")
    sender.release_sender_touches()
    for i in range(8, 16):
        send(f"x{i}")
    assert not sender.is_cached_item("a") and not sender.is_cached_item("x7")


def test_is_cached_pins_the_hits_until_used_or_released(one_worker: Any) -> None:
    """vLLM asks is_cached, then processes the misses (which may evict), then touches: the
    hits are pinned from is_cached on. A request whose processing fails never uses them: they
    are given back at the next release, and the store evicts them again."""
    sender, receiver, send = one_worker
    send("a")
    send("b")
    assert sender.is_cached(["a", "b", "c"]) == [True, True, False]
    for i in range(8):  # a miss processed meanwhile, several times the store
        send(f"x{i}")
    assert sender.is_cached(["a", "b"]) == [True, True]  # both held
    out, _ = sender.get_and_update_item(None, "a")  # a's request goes on
    receiver.get_and_update_item(over_the_wire(out), "a")
    sender.release_sender_touches()  # b's request failed: b goes back
    assert sender.store.unread(sender.store.handle_of("b")) == (0,)  # nothing owed
    for i in range(8, 16):
        send(f"x{i}")
    assert sender.is_cached(["a", "b"]) == [False, False]
    assert sender.store.stats().reader_lag == (0,)


def test_oversize_and_full_are_sent_inline_never_dropped(name: str) -> None:
    cfg = config(name, cache_mb=4, max_object_mb=2, world_size=1)
    sender = ShmstoreSenderCache(cfg)
    try:
        big = image_item(3, nbytes=3 * MB)
        assert sender.get_and_update_item((big, ["b"]), "big") == (big, ["b"])
        small = [image_item(10 + i) for i in range(4)]
        outs = [sender.get_and_update_item((it, []), f"s{i}")[0] for i, it in enumerate(small)]
        # nobody reads: the store fills, later items go inline with their data
        assert any(HANDLE_FIELD in o for o in outs) and outs[-1] is small[-1]
        assert sender.items["inline"] == 2
    finally:
        sender.close()


def test_clear_keeps_hand_outs_in_flight_and_then_fails_loudly(caches: Any) -> None:
    sender, receivers = caches
    item = image_item(4)
    out, _ = sender.get_and_update_item((item, []), "h4")
    sender.clear_cache()
    assert not sender.is_cached_item("h4")  # new requests find nothing
    assert same_item(receivers[0].get_and_update_item(over_the_wire(out), "h4"), item)
    receivers[1].get_and_update_item(over_the_wire(out), "h4")  # the request in flight is served
    sender.clear_cache()
    with pytest.raises(MultiModalCacheMissError) as info:  # read by all: now it is gone
        receivers[0].get_and_update_item(over_the_wire(out), "h4")
    assert info.value.mm_hashes == ["h4"]


def test_validate_input_item_refuses_forged_stale_and_foreign_handles(caches: Any, name: str) -> None:
    sender, _ = caches
    out, _ = sender.get_and_update_item((image_item(5), []), "h5")
    sender.validate_input_item(out, "h5")  # its own current handle
    sender.validate_input_item(image_item(6), "h6")  # data, not a handle
    with pytest.raises(ValueError, match="did not issue"):
        sender.validate_input_item(out, "other-hash")
    forged = MultiModalKwargsItem(dict(out))
    words = list(out[HANDLE_FIELD].data)
    words[HANDOUT_WORDS.index("seq")] += 1
    forged[HANDLE_FIELD] = MultiModalFieldElem(data=words, field=out[HANDLE_FIELD].field)
    with pytest.raises(ValueError, match="did not issue"):
        sender.validate_input_item(forged, "h5")
    at = HANDOUT_WORDS.index("number")
    for number in (0, words[at] + (1 << 40)):  # a hand-out the store never made: the worker
        words = list(out[HANDLE_FIELD].data)  # refuses it, and so does the API server
        words[at] = number
        forged[HANDLE_FIELD] = MultiModalFieldElem(data=words, field=out[HANDLE_FIELD].field)
        with pytest.raises(ValueError, match="did not issue"):
            sender.validate_input_item(forged, "h5")
    for bad in ([1, 2, 3], [1, 2, 3, 4, -5], "x", [1, 2, 3, 4, 2**64]):
        junk = MultiModalKwargsItem({HANDLE_FIELD: MultiModalFieldElem(
            data=bad, field=out[HANDLE_FIELD].field)})
        with pytest.raises(ValueError, match="malformed"):
            sender.validate_input_item(junk, "h5")
    with ObjectStore.create(name + "-other", capacity_bytes=1 << 20, n_readers=1) as other:
        foreign = other.put("h5", {"x": 1})
        assert handout_from_item(out).handle != foreign
    sender.clear_cache()
    with pytest.raises(ValueError, match="did not issue"):
        sender.validate_input_item(out, "h5")  # stale


@pytest.mark.parametrize(("word", "change"), [("id_2", 1), ("id_2", -1), ("id_0", 1),
                                              ("id_1", -1), ("number", 1 << 40),
                                              ("number", None)])
def test_a_worker_refuses_a_handle_item_whose_object_id_or_hand_out_word_is_wrong(
        caches: Any, word: str, change: int | None) -> None:
    """Every word of a handle item is checked, not the handle's only: a damaged object id
    (its origin seq, or a digest that is not the handle's) or a replayed hand-out number takes
    no read another request still needs."""
    sender, receivers = caches
    out, _ = sender.get_and_update_item((image_item(8), []), "h8")
    handle = handout_from_item(out).handle
    words = list(out[HANDLE_FIELD].data)
    at = HANDOUT_WORDS.index(word)
    words[at] = 0 if change is None else words[at] + change
    bad = MultiModalKwargsItem(dict(out))
    bad[HANDLE_FIELD] = MultiModalFieldElem(data=words, field=out[HANDLE_FIELD].field)
    with pytest.raises(MultiModalCacheMissError):
        receivers[0].get_and_update_item(over_the_wire(bad), "h8")
    assert sender.store.unread(handle) == (1, 1)  # nobody's read was taken
    for receiver in receivers:  # the real one still reads, once per worker
        assert same_item(receiver.get_and_update_item(over_the_wire(out), "h8"), image_item(8))
    assert sender.store.unread(handle) == (0, 0)


def test_features_without_data_are_skipped_and_handles_resolved(caches: Any) -> None:
    sender, receivers = caches
    item = image_item(7)
    out, _ = sender.get_and_update_item((item, []), "h7")
    for r in receivers:
        features = [
            MultiModalFeatureSpec(data=over_the_wire(out), modality="image", identifier="h7",
                                  mm_position=PlaceholderRange(offset=3, length=10), mm_hash="h7"),
            MultiModalFeatureSpec(data=None, modality="image", identifier="gone",
                                  mm_position=PlaceholderRange(offset=20, length=10)),
        ]
        got = r.get_and_update_features(features)
        assert same_item(got[0].data, item) and got[1].data is None
    assert sender.store.stats().reader_lag == (0, 0)


def _read_then_die(name: str, attached: Any) -> None:
    os.environ["VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME"] = name
    os.environ["LOCAL_RANK"] = "1"
    receiver = ShmstoreReceiverCache(config(name), None)
    assert receiver.reader.reader == 1
    attached.set()
    signal.pause()


@pytest.mark.slow
def test_a_killed_worker_does_not_wedge_the_sender(name: str) -> None:
    cfg = config(name, cache_mb=6, max_object_mb=6, world_size=2)
    sender = ShmstoreSenderCache(cfg)
    receiver = ShmstoreReceiverCache(cfg, None)
    attached = SPAWN.Event()
    p = SPAWN.Process(target=_read_then_die, args=(name, attached))
    p.start()
    try:
        assert attached.wait(60)
        out, _ = sender.get_and_update_item((image_item(8), []), "first")
        receiver.get_and_update_item(over_the_wire(out), "first")
        os.kill(p.pid, signal.SIGKILL)  # worker 1 dies owing "first"
        p.join(30)
        for i in range(12):  # twice the store: "first" must be reclaimed, nothing inline
            out, _ = sender.get_and_update_item((image_item(20 + i), []), f"k{i}")
            assert HANDLE_FIELD in out
            receiver.get_and_update_item(over_the_wire(out), f"k{i}")
        assert sender.items["inline"] == 0 and sender.store.stats().dead_readers == 1
    finally:
        p.kill()
        p.join(30)
        receiver.close()
        sender.close()


@pytest.mark.slow
def test_the_plugin_routes_only_the_shm_type_and_can_be_turned_off(name: str) -> None:
    from shmstore.vllm import plugin as vllm_plugin

    vllm_plugin.register()
    import vllm.renderers.base
    import vllm.v1.worker.worker_base

    assert vllm.renderers.base.processor_cache_from_config is factories.processor_cache_from_config
    sender = vllm.renderers.base.processor_cache_from_config(config(name, world_size=1))
    try:
        assert isinstance(sender, ShmstoreSenderCache)
        receiver = vllm.v1.worker.worker_base.worker_receiver_cache_from_config(
            config(name, world_size=1), None)  # no lock (the Ray executor): works
        assert isinstance(receiver, ShmstoreReceiverCache)
    finally:
        sender.close()
    assert vllm.v1.worker.worker_base.worker_receiver_cache_from_config(
        config(name, cache_type="lru"), None) is None  # vLLM's own answer for lru
    code = ("import vllm.multimodal.cache.factories as f; from shmstore.vllm import plugin as vllm_plugin; "
            "vllm_plugin.register(); print(f.processor_cache_from_config.__module__)")
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SHMSTORE_VLLM": "0"})
    assert off.stdout.strip() == "vllm.multimodal.cache.factories", off.stderr[-2000:]


def test_register_wraps_every_request_hook_once() -> None:
    """Each method where vLLM adds, routes, renders, refuses, finishes or aborts a request, or
    where a worker resolves a new request's items, is wrapped, and a second register() does
    not wrap it again."""
    import importlib

    from shmstore.vllm import plugin as vllm_plugin

    vllm_plugin.register()
    hooked = {("vllm.v1.engine.output_processor", "OutputProcessor"):
              ("add_request", "_finish_request", "abort_requests", "process_outputs"),
              ("vllm.v1.engine.core_client", "DPAsyncMPClient"): ("get_core_engine_for_request",),
              ("vllm.v1.engine.core_client", "DPLBAsyncMPClient"): ("get_core_engine_for_request",),
              ("vllm.renderers.base", "BaseRenderer"):
              ("render_chat_async", "render_cmpl_async", "_process_tokens_async"),
              ("vllm.v1.engine.input_processor", "InputProcessor"): ("process_inputs",),
              ("vllm.v1.worker.worker_base", "WorkerWrapperBase"): ("_apply_mm_cache",)}
    methods = {}
    for (module, cls), names in hooked.items():
        owner = getattr(importlib.import_module(module), cls)
        for method in names:
            methods[(cls, method)] = getattr(owner, method)
            assert getattr(methods[(cls, method)], "_shmstore_hook", False), (cls, method)
    from shmstore.vllm._hooks import install_request_hooks

    install_request_hooks()
    for (module, cls), names in hooked.items():
        owner = getattr(importlib.import_module(module), cls)
        assert all(getattr(owner, m) is methods[(cls, m)] for m in names)  # not wrapped twice


@pytest.mark.parametrize(("value", "on"), [("0", False), ("off", False), ("False", False),
                                           ("no", False), (" 1 ", True), ("on", True),
                                           ("TRUE", True), ("", True)])
def test_shmstore_vllm_accepts_the_usual_switch_words(value: str, on: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from shmstore.vllm import plugin as vllm_plugin

    monkeypatch.setenv("SHMSTORE_VLLM", value)
    assert vllm_plugin.enabled() is on


@pytest.mark.parametrize("value", ["2", "disable", "of", "0n"])
def test_shmstore_vllm_refuses_anything_else_naming_the_variable(
        value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from shmstore.vllm import plugin as vllm_plugin

    monkeypatch.setenv("SHMSTORE_VLLM", value)
    with pytest.raises(InvalidArgument, match=r"SHMSTORE_VLLM=.* is not a switch") as info:
        vllm_plugin.register()
    assert info.value.argument == "SHMSTORE_VLLM"


def test_store_statistics_are_exported_as_prometheus_metrics(caches: Any) -> None:
    from prometheus_client import generate_latest

    sender, receivers = caches
    out, _ = sender.get_and_update_item((image_item(9), []), "h9")
    receivers[0].get_and_update_item(over_the_wire(out), "h9")  # reader 1 has not read it
    sender.get_and_update_item((image_item(10, nbytes=40 * MB), []), "huge")  # inline
    text = generate_latest().decode()
    segment = sender.store.name
    for line in (f'shmstore_puts_total{{segment="{segment}"}} 1.0',
                 f'shmstore_inline_fallbacks_total{{api_server="0",segment="{segment}"}} 1.0',
                 'shmstore_vllm_items_total{api_server="0",outcome="stored",'
                 f'segment="{segment}"}} 1.0',
                 'shmstore_vllm_items_total{api_server="0",outcome="inline",'
                 f'segment="{segment}"}} 1.0',
                 f'shmstore_objects{{segment="{segment}"}} 1.0',
                 f'shmstore_reader_lag{{reader="0",segment="{segment}"}} 0.0',
                 f'shmstore_reader_lag{{reader="1",segment="{segment}"}} 1.0',
                 f'shmstore_dead_readers_total{{segment="{segment}"}} 0.0'):
        assert line in text, line
    assert f'shmstore_bytes_in_use{{segment="{segment}"}} 0.0' not in text
    receivers[1].get_and_update_item(over_the_wire(out), "h9")
    sender.close()
    assert "shmstore_puts_total" not in generate_latest().decode()  # gone with the cache


def test_a_stored_item_whose_prompt_updates_were_dropped_is_a_miss_and_then_a_hit(
        caches: Any) -> None:
    sender, receivers = caches
    item = image_item(11)
    out, _ = sender.get_and_update_item((item, ["u"]), "h11")
    for r in receivers:
        r.get_and_update_item(over_the_wire(out), "h11")
    sender._updates.clear()  # as if P0 had lost them (vLLM cannot be handed out without them)
    assert not sender.is_cached_item("h11")
    out, updates = sender.get_and_update_item((item, ["u2"]), "h11")  # no KeyExists
    assert updates == ["u2"] and sender.store.stats().puts == 1  # stored once, handed out again
    for r in receivers:
        assert same_item(r.get_and_update_item(over_the_wire(out), "h11"), item)
    assert sender.is_cached_item("h11")


def test_without_a_name_each_server_gets_vllms_unique_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME")
    sender = ShmstoreSenderCache(config("unused", world_size=1))
    try:
        name = sender.store.name
        assert name.startswith("vllm_mm_")  # vLLM's per-process-tree name, not a fixed one
        assert os.environ["VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME"] == name  # workers inherit it
        receiver = ShmstoreReceiverCache(config("unused", world_size=1), None)
        out, _ = sender.get_and_update_item((image_item(12), []), "h12")
        assert same_item(receiver.get_and_update_item(over_the_wire(out), "h12"),
                         image_item(12))
        receiver.close()
    finally:
        sender.close()


# -- a TP group across nodes (vLLM --nnodes): the head publishes, node 1 reads via its relay --

def test_a_tp_group_across_nodes_needs_the_relay_address(name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PUBLISH_ENV, raising=False)
    with pytest.raises(InvalidArgument, match=f"{PUBLISH_ENV}=tcp://.*shmstore relay connect"):
        ShmstoreSenderCache(config(name, nodes=2))
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(name)]


def test_a_worker_on_another_node_needs_its_relay_channel(name: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SegmentNotFound, match=f"relay connect tcp://HEAD:PORT --name {name}"):
        ShmstoreReceiverCache(config(name, nodes=2, node_rank=1), None)
    monkeypatch.setenv(WAIT_ENV, "soon")
    with pytest.raises(InvalidArgument, match=WAIT_ENV):
        ShmstoreReceiverCache(config(name, nodes=2, node_rank=1), None)


def test_across_nodes_the_other_node_reads_every_item_from_its_relay(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    node = f"{name}-n1"
    monkeypatch.setenv(PUBLISH_ENV, "tcp://127.0.0.1:*")
    monkeypatch.setenv(WAIT_ENV, "0.5")
    head_cfg = config(name, nodes=2)
    with pytest.raises(InvalidArgument, match=f"without CurveZMQ keys.*{INSECURE_ENV}|keygen"):
        ShmstoreSenderCache(head_cfg)  # plain TCP only when asked for
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(name)]
    monkeypatch.setenv(INSECURE_ENV, "1")
    sender = ShmstoreSenderCache(head_cfg)
    local = ShmstoreReceiverCache(head_cfg, None)
    relay = remote = None
    try:
        # no relay connected yet: the data goes inline; a hit without data cannot reach node 1
        item0 = image_item(0)
        assert sender.get_and_update_item((item0, ["u0"]), "h0") == (item0, ["u0"])
        with pytest.raises(MultiModalCacheMissError):
            sender.get_and_update_item(None, "h0")
        assert sender.items["inline"] == 1
        # the default peer timeout (3 s): a relay that reconnects after a loaded machine's 1-2 s
        # silence loses what was on the way, and silences are not what this test is about
        relay = Relay(sender.publisher.endpoint, node, n_readers=1,
                      security=RelaySecurity(plaintext=True), timing=Timing(heartbeat_s=0.1),
                      channel=NodeChannel(capacity_bytes=64 * MB))
        monkeypatch.setenv("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", node)  # node 1's name
        remote = ShmstoreReceiverCache(config(node, nodes=2, node_rank=1), None)
        relay.wait_for_readers(10)
        relay.start()
        sender.publisher.wait_for_nodes(1, 10)
        items = {f"h{i}": image_item(i) for i in range(1, 4)}
        outs = {h: over_the_wire(sender.get_and_update_item((it, []), h)[0])
                for h, it in items.items()}
        sender.touch_sender_cache_item("h1")
        sender.get_and_update_item((image_item(4), []), "h4")  # handed out, never scheduled
        outs["h1 again"] = over_the_wire(sender.get_and_update_item(None, "h1")[0])  # the touch
        assert all(HANDLE_FIELD in out for out in outs.values())
        # workers get items in scheduling order, not hand-out order
        for h in ["h3", "h1 again", "h1", "h2"]:
            key = h.split()[0]
            assert same_item(remote.get_and_update_item(outs[h], key), items[key])
            assert same_item(local.get_and_update_item(outs[h], key), items[key])
        stats = relay.stats()
        assert (stats.objects_received, stats.refs_hit, stats.needs, stats.lost) == (4, 1, 0, 0)
        # hits: h0's refused one (given back, as h0's inline put was) and the touch, whose
        # renewal is neither a hit nor a give-back
        assert (sender.store.stats().hits, sender.store.stats().give_backs) == (2, 2)
        # a handle that never reaches node 1 (another object id): a bounded wait, then a miss
        forged = MultiModalKwargsItem(dict(outs["h2"]))
        words = list(forged[HANDLE_FIELD].data)
        words[HANDOUT_WORDS.index("id_2")] += 1  # the origin seq of its object id
        forged[HANDLE_FIELD] = MultiModalFieldElem(data=words, field=forged[HANDLE_FIELD].field)
        started = time.monotonic()
        with pytest.raises(MultiModalCacheMissError):
            remote.get_and_update_item(forged, "h2")
        assert 0.4 < time.monotonic() - started < 5
        # handles no request here asks for are kept up to a bound, then given up oldest first
        monkeypatch.setattr("shmstore.serving._nodes.MAX_WAITING", 1)
        later = {f"h{i}": over_the_wire(sender.get_and_update_item((image_item(i), []), f"h{i}")[0])
                 for i in (5, 6, 7)}
        assert same_item(remote.get_and_update_item(later["h7"], "h7"), image_item(7))
        assert remote.feed is not None and remote.feed.dropped == 2  # h4, then h5
        assert relay.channel.store.stats().reader_lag == (1,)  # h6 still kept, owed
        # the relay ends (or dies): items go inline; a new relay on the same name takes over
        relay.close()
        remote.get_and_update_features([])  # a step: the worker notices
        assert remote.feed.reader is None
        deadline = time.monotonic() + 10  # it said BYE: the head drops it
        while sender.publisher.nodes_connected and time.monotonic() < deadline:
            time.sleep(0.01)
        item9 = image_item(9)
        assert sender.get_and_update_item((item9, []), "h9") == (item9, [])
        relay = Relay(sender.publisher.endpoint, node, n_readers=1,
                      security=RelaySecurity(plaintext=True), timing=Timing(heartbeat_s=0.1),
                      channel=NodeChannel(capacity_bytes=64 * MB))
        deadline = time.monotonic() + 10
        while remote.feed.reader is None and time.monotonic() < deadline:
            remote.get_and_update_features([])  # steps: a try per second
            time.sleep(0.05)
        assert remote.feed.reattached == 1
        relay.wait_for_readers(10)
        relay.start()
        sender.publisher.wait_for_nodes(1, 10)
        out10 = over_the_wire(sender.get_and_update_item((image_item(10), []), "h10")[0])
        assert HANDLE_FIELD in out10
        wait_for(lambda: relay.stats().objects_received == 1, 30, "h10 at node 1's relay")
        assert same_item(remote.get_and_update_item(out10, "h10"), image_item(10))
        sender.publisher.stop()
        assert sender.publisher.result(10) == "closed" and not sender.publisher.serving
        item8 = image_item(8)  # a publisher that stopped: the data goes inline, not lost
        assert sender.get_and_update_item((item8, []), "h8") == (item8, [])
    finally:
        for cache in (remote, local):
            if cache is not None:
                cache.close()
        sender.close()
        if relay is not None:
            relay.close()
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(name)]


def test_across_nodes_with_curve_keys_only_listed_relays_get_handles(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for who in ("head", "node1", "stranger"):
        generate_keys(tmp_path, who)
    monkeypatch.setenv(PUBLISH_ENV, "tcp://127.0.0.1:*")
    monkeypatch.setenv(KEYS_ENV, str(tmp_path / "missing.key_secret"))
    with pytest.raises(InvalidArgument, match="relay keygen"):
        ShmstoreSenderCache(config(name, nodes=2))
    monkeypatch.setenv(KEYS_ENV, str(tmp_path / "head.key_secret"))
    monkeypatch.setenv(ALLOW_ENV, str(tmp_path / "node1.key"))
    sender = ShmstoreSenderCache(config(name, nodes=2))
    server = CurveKeys.load(tmp_path / "head.key").public
    relays = []
    try:
        stranger = Relay(sender.publisher.endpoint, f"{name}-x", n_readers=1,
                         timing=Timing(heartbeat_s=0.1),
                         security=RelaySecurity(CurveKeys.load(tmp_path / "stranger.key_secret"),
                                                server),
                         channel=NodeChannel(capacity_bytes=16 * MB))
        relays.append(stranger)
        stranger.start()
        time.sleep(1.0)
        assert sender.publisher.nodes_connected == 0  # refused at the handshake
        item = image_item(1)
        assert sender.get_and_update_item((item, []), "h1") == (item, [])  # inline
        listed = Relay(sender.publisher.endpoint, f"{name}-n1", n_readers=1,
                       timing=Timing(heartbeat_s=0.1),
                       security=RelaySecurity(CurveKeys.load(tmp_path / "node1.key_secret"),
                                              server),
                       channel=NodeChannel(capacity_bytes=16 * MB))
        relays.append(listed)
        listed.start()
        sender.publisher.wait_for_nodes(1, 10)
        assert HANDLE_FIELD in sender.get_and_update_item((image_item(2), []), "h2")[0]
        assert stranger.stats().objects_received == 0
    finally:
        sender.close()
        for relay in relays:
            relay.close()


def test_a_node_feed_skips_what_it_cannot_use_and_follows_a_relay_that_died(name: str) -> None:
    """The worker side alone: a relay process that sends an inline value (skipped) and an
    object, then is SIGKILLed; the feed notices at a poll and takes a new relay's channel."""
    sent = SPAWN.Event()
    relay = SPAWN.Process(target=fake_relay_main, args=(name, sent))
    relay.start()
    feed = None
    replacement = None
    try:
        deadline = time.monotonic() + 60
        while feed is None:
            try:
                feed = NodeFeed(name, 1, wait_s=60.0)
            except SegmentNotFound:
                assert time.monotonic() < deadline, "the relay process never made its channel"
                time.sleep(0.05)
        assert sent.wait(60)
        feed.poll()  # the inline value is skipped (logged), the handle kept
        assert feed.get(b"id-1") == {"x": 1}
        os.kill(relay.pid, signal.SIGKILL)
        relay.join()
        deadline = time.monotonic() + 10
        while feed.reader is not None and time.monotonic() < deadline:
            feed.poll()  # a step: notices the dead writer within its liveness check
            time.sleep(0.05)
        assert feed.reader is None
        with pytest.raises(Closed, match="waiting for a new relay"):
            feed.get(b"id-1")
        replacement = Channel.create(name, n_readers=1, capacity_bytes=4 << 20)  # takes over
        deadline = time.monotonic() + 10
        while feed.reattached == 0 and time.monotonic() < deadline:
            feed.poll()  # a try per second
            time.sleep(0.05)
        assert feed.reattached == 1
        replacement.publish(replacement.store.hand_out_new(b"id-2", {"y": 2}))
        assert feed.get(b"id-2") == {"y": 2}
    finally:
        if feed is not None:
            feed.close()
        if replacement is not None:
            replacement.close()
        if relay.is_alive():
            relay.kill()
        relay.join()
    assert not [p for p in Path("/dev/shm").iterdir() if name in p.name]


@pytest.mark.slow
def test_a_store_whose_writer_was_killed_is_removed_at_exit_and_nothing_else(
        name: str, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's launcher SIGKILLs its API servers at shutdown: whichever process of the server
    exits after the writer removes its store. A live writer's store, and a segment of that name
    that is not shmstore's (vLLM's own), are left alone; one whose lock a live process still
    holds is left to the writer's tracker, with a line that says so."""
    path = os.path.join("/dev/shm", name)
    made = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from shmstore import ObjectStore; "
        f"s = ObjectStore.create({name!r}, capacity_bytes=1 << 20, n_readers=1); print('made', flush=True); "
        "time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert made.stdout is not None and made.stdout.readline().strip() == "made"
        _remove_if_orphaned(name)
        assert os.path.exists(path)  # its writer lives
        made.kill()  # at once, as vLLM's launcher does: the parent waits for it to be gone
        held = os.open(path, os.O_RDONLY)  # a live process holds its lock: left, and said
        try:
            fcntl.flock(held, fcntl.LOCK_SH)
            with caplog.at_level(logging.INFO, logger=LOG_NAME):
                _remove_if_orphaned(name)
            assert os.path.exists(path)
            assert "left to its writer's tracker" in caplog.text
        finally:
            os.close(held)
        _remove_if_orphaned(name)  # (a zombie, not reaped: dead)
        assert not os.path.exists(path)
    finally:
        made.kill()
        made.wait()
    foreign = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=4096)
    try:
        _remove_if_orphaned(name)
        assert os.path.exists(path)  # not a shmstore segment: not ours to remove
    finally:
        foreign.close_fd()
        foreign.unlink()


def test_the_sender_starts_without_prometheus_client(name: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM ships prometheus_client, other embedders may not: the sender then serves without
    metrics instead of failing to start."""
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    sender = ShmstoreSenderCache(config(name))
    try:
        out, _ = sender.get_and_update_item((image_item(3), []), "h3")
        assert HANDLE_FIELD in out
    finally:
        sender.close()


def test_releasing_a_touch_gives_back_that_hand_out_not_the_objects_last(caches: Any) -> None:
    """A touch left over (a failed merge) goes back by its number: a later hand-out of the same
    object (another API server's, narrowed to its engine) stays owed."""
    sender, _ = caches
    sender.get_and_update_item((image_item(4), ["u"]), "h4")
    assert sender.is_cached(["h4"]) == [True]  # the touch: a hand-out kept
    store = sender.store
    handle = store.handle_of("h4")
    later = store.hand_out(handle).number  # another server's, made after it
    store.narrow(handle, later, [0])
    sender.release_sender_touches()
    store.give_back(handle, later)  # still there to give back: the touch went, not this one


def test_a_node_feed_waits_for_a_relay_channel_still_being_created(name: str) -> None:
    """A worker that starts while its node's relay is creating the channel (the header not
    written whole yet) is told to try again (SegmentNotFound), not that the name is foreign."""
    import posix_ipc

    from shmstore.errors import IncompatibleSegment
    from shmstore.shm._header import MAKING_MAGIC, SEGMENT_HEADER

    half = posix_ipc.SharedMemory("/" + name + ".queue", posix_ipc.O_CREX, size=4096)
    try:
        os.pwrite(half.fd, MAKING_MAGIC + bytes(SEGMENT_HEADER.size - 8), 0)
        with pytest.raises(SegmentNotFound, match="still being created"):
            NodeFeed(name, 1, wait_s=1.0)
        os.pwrite(half.fd, b"NOTOURS!" + bytes(SEGMENT_HEADER.size - 8), 0)
        with pytest.raises(IncompatibleSegment):
            NodeFeed(name, 1, wait_s=1.0)  # a name another program uses: not waited for
    finally:
        half.close_fd()
        half.unlink()


@pytest.mark.parametrize(("value", "workers"), [("0", 0), ("off", 0), ("3", 3), ("auto", None),
                                                ("", None)])
def test_the_pool_size_setting(value: str, workers: int | None, name: str,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A number, 0/off, or unset/auto: the cores the server's processes leave free (here one
    API server and one engine of 2 workers take 4), 2 to 8, else none; the log says how."""
    from shmstore.serving._pool import default_workers
    from shmstore.vllm._deployment import Deployment

    monkeypatch.setenv("SHMSTORE_VLLM_POOL", value)
    d = Deployment.read(config(name))
    expected = default_workers(taken=4) if workers is None else workers
    assert d.pool_workers == expected
    assert "SHMSTORE_VLLM_POOL" in d.pool_why
    if workers is None and not expected:
        assert "set SHMSTORE_VLLM_POOL=N to run one" in d.pool_why


@pytest.mark.parametrize("value", ["many", "-1", "257", "2.5"])
def test_a_pool_size_it_cannot_take_is_refused_naming_the_variable(
        value: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from shmstore.vllm._deployment import Deployment

    monkeypatch.setenv("SHMSTORE_VLLM_POOL", value)
    with pytest.raises(InvalidArgument, match=r"SHMSTORE_VLLM_POOL") as info:
        Deployment.read(config(name))
    assert info.value.argument == "SHMSTORE_VLLM_POOL"

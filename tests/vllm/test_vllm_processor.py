"""vLLM's real multimodal processor (the tiny LLaVA's, vLLM 0.32's `processor(...)`, its hooks
installed) with shmstore's senders of two API servers as its cache: an image the first API
server processed is, on the second, a hit that runs no HF processor and decodes no image, and
gives the prompt ids and placeholder ranges vLLM alone gives. A corrupt JPEG gets vLLM's own
error, on any API server."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("transformers")

from PIL import Image
from vllm.multimodal.media.image import ImageMediaIO

from shmstore.vllm._accel import LazyImage
from shmstore.vllm._hooks import install_request_hooks
from tests.vllm import test_vllm_shared as shared
from tests.vllm.tiny_llava import build

pytestmark = pytest.mark.timeout(300)
node, segment_name = shared.node, shared.segment_name  # two API servers on one store
PROMPT = "USER: <image>\ndescribe the image ASSISTANT:"


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.config import ModelConfig

    model = build(tmp_path_factory.mktemp("tiny-llava"))
    return ModelConfig(model=str(model), max_model_len=256, enforce_eager=True)


@pytest.fixture(scope="module")
def processor(model_config: Any) -> Iterator[Any]:
    from vllm.multimodal import MULTIMODAL_REGISTRY

    install_request_hooks()  # as the plugin does in every process: before the senders
    yield MULTIMODAL_REGISTRY.create_processor(model_config)


def jpeg(seed: int, keep: float = 1.0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (120, 160, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()[:int(len(out.getvalue()) * keep)]


def run(processor: Any, data: bytes, cache: Any, calls: list[int]) -> Any:
    """One request as vLLM's renderer makes it: the image loaded (lazily, under shmstore),
    then processed with `cache`; (prompt ids, placeholder ranges, the media)."""
    load = ImageMediaIO.load_bytes  # lazy once a sender made it so
    media = (load if cache is not None else getattr(load, "__wrapped__", load))(
        ImageMediaIO(), data)  # vLLM alone: its own eager load
    items = processor.info.parse_mm_data({"image": [media]})
    before = len(calls)
    out = processor(PROMPT, items, cache=cache)
    if cache is not None:
        cache.release_sender_touches()
    placeholders = [(p.offset, p.length) for p in out["mm_placeholders"]["image"]]
    return out["prompt_token_ids"], placeholders, media, len(calls) - before


@pytest.fixture
def counted(processor: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each HF processor call appends to the list."""
    calls: list[int] = []
    context = type(processor.info.ctx)  # a frozen dataclass: its class is patched
    original = context.call_hf_processor

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(context, "call_hf_processor", counting)
    return calls


def test_another_api_servers_item_needs_no_processor_and_no_decode(
        processor: Any, node: Any, counted: list[int]) -> None:
    (first, second), _ = node
    assert first.accel.lazy_images and second.accel.lazy_images
    for seed in range(4):
        data = jpeg(seed)
        ids, places, _, _ = run(processor, data, None, counted)  # vLLM alone, no cache
        got_first = run(processor, data, first, counted)
        assert got_first[:2] == (ids, places) and got_first[3] == 1  # a miss: processed
        assert isinstance(got_first[2], LazyImage) and got_first[2].realized
        got_second = run(processor, data, second, counted)
        assert got_second[:2] == (ids, places)
        assert got_second[3] == 0  # no HF processor on API server 1
        assert isinstance(got_second[2], LazyImage) and not got_second[2].realized
        again = run(processor, data, first, counted)  # a plain hit on API server 0
        assert again[:2] == (ids, places) and again[3] == 0 and not again[2].realized
    assert second.accel.skipped == {"decode": 4, "processor": 4}
    assert first.accel.skipped == {"decode": 4, "processor": 0}
    assert first.store.stats().puts == 4 and second.items["shared"] == 0


def test_a_corrupt_jpeg_gets_vllms_error_and_is_never_stored(
        processor: Any, node: Any, counted: list[int]) -> None:
    (first, second), _ = node
    data = jpeg(9, keep=0.5)
    with pytest.raises(ValueError) as alone:
        ImageMediaIO.load_bytes.__wrapped__(ImageMediaIO(), data)  # vLLM's eager load
    for sender in (first, second):
        with pytest.raises(ValueError) as lazily:
            run(processor, data, sender, counted)
        assert str(lazily.value) == str(alone.value)
        assert "Failed to load image" in str(lazily.value)
        sender.release_sender_touches()
    assert counted == [] and first.store.stats().puts == 0


def test_with_the_acceleration_off_every_api_server_processes_as_vllm_does(
        processor: Any, name: str, counted: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """SHMSTORE_VLLM_ACCELERATE=0: images decoded as they arrive (even in a process where
    senders with it on were open before), no records: the second API server runs the HF
    processor for an item the first stored, and gets vLLM's prompt ids and placeholders."""
    from shmstore.vllm._sender import ShmstoreSenderCache

    monkeypatch.setenv("SHMSTORE_VLLM_ACCELERATE", "0")
    senders = [ShmstoreSenderCache(shared.config(name, cache_mb=shared.cache_mb(), world_size=1,
                                                 api_servers=2, api_rank=r, dp=2))
               for r in range(2)]
    try:
        first, second = senders
        assert not first.accel.on and not first.accel.lazy_images
        for seed in range(2):
            data = jpeg(20 + seed)
            ids, places, _, _ = run(processor, data, None, counted)
            for sender, processed in ((first, 1), (second, 1), (first, 0), (second, 0)):
                got = run(processor, data, sender, counted)
                assert got[:2] == (ids, places) and got[3] == processed
                assert not isinstance(got[2], LazyImage)  # decoded as it arrived
        assert first.accel.skipped == second.accel.skipped == {"decode": 0, "processor": 0}
        assert second.accel.refused == dict.fromkeys(second.accel.refused, 0)  # none read
        assert first.store.stats().puts == 2 and second.items["shared"] == 2
    finally:
        for sender in reversed(senders):
            sender.close()


@pytest.mark.slow
def test_the_miss_pool_processes_a_new_image_into_a_hit_that_equals_vllm_alone(
        processor: Any, model_config: Any, node: Any, counted: list[int]) -> None:
    """A pool worker (vLLM's own processor, in its own process) stores a request's new image
    before vLLM's thread processes it: there it is a hit that runs no HF processor and decodes
    nothing, with vLLM alone's prompt ids and placeholders, counted as new (a miss in vLLM's
    counters, "pooled" in shmstore's); the same image sent again is a hit. A corrupt JPEG
    fails in the pool and gets vLLM's own error on the API server, as without the pool. An
    item named by a uuid is not sent (the pool would decline it)."""
    import types

    from shmstore.serving._deployment import NodePool
    from shmstore.serving._outcome import STORED
    from shmstore.serving._photos import PhotoOutbox
    from shmstore.serving._pool import MissPool
    from shmstore.vllm._accel._pool import PoolSender
    from shmstore.vllm._accel._pool import processor as pool_processor
    from tests._waiting import wait_for

    (first, second), _ = node
    renderer = types.SimpleNamespace(get_mm_processor=lambda: processor)
    missed = MissPool(first._writers, pool_processor(model_config), workers=1)
    pool = PoolSender(NodePool(pool=missed, outbox=PhotoOutbox(first.deployment.name)))
    first.pool = second.pool = pool  # as each API server's sender holds its way in
    try:
        wait_for(lambda: missed.stats().ready == 1, 240, "the pool's worker")

        def before(data: bytes, sender: Any, uuid: str | None = None) -> list[str]:
            media = ImageMediaIO.load_bytes(ImageMediaIO(), data)  # lazy, as the server loads
            prompt: dict[str, Any] = {"prompt_token_ids": [1, 2],
                                      "multi_modal_data": {"image": [media]}}
            if uuid is not None:
                prompt["multi_modal_uuids"] = {"image": [uuid]}
            futures = pool.jobs(renderer, prompt, sender.accel.fingerprint, sender._core.stored)
            return [f.result(timeout=240) for f in futures]

        for seed, sender in ((40, first), (41, second)):
            data = jpeg(seed)
            ids, places, _, _ = run(processor, data, None, counted)  # vLLM alone
            hits, items = sender.make_stats().hits, dict(sender.items)
            assert before(data, sender) == [STORED]
            got = run(processor, data, sender, counted)
            assert got[:2] == (ids, places)
            assert got[3] == 0 and isinstance(got[2], LazyImage) and not got[2].realized
            assert sender.make_stats().hits == hits  # new to this request: not a hit
            assert sender.items["pooled"] == items["pooled"] + 1
            assert sender.items["hit"] == items["hit"]
            assert before(data, sender) == []  # stored: nothing goes to the pool again
            run(processor, data, sender, counted)  # sent again: a true hit
            assert sender.make_stats().hits == hits + 1
        stats = missed.stats()
        assert (stats.submitted, stats.stored, stats.waited) == (2, 2, 0)
        assert pool.snapshot()["sent"] == pool.snapshot()["stored"] == 2
        assert first.store.stats().puts == 2
        assert pool.node.photos_inline == 0  # each photo by shared memory

        assert before(jpeg(43), first, uuid="my-photo") == []  # named: processed where it is
        bad = jpeg(42, keep=0.5)
        assert before(bad, first) == ["failed"]
        with pytest.raises(ValueError, match="Failed to load image"):
            run(processor, bad, first, counted)
        first.release_sender_touches()
        assert missed.stats().fallback["failed"] == 1
        assert len(counted) == 2  # vLLM alone's two runs: none on the API servers
    finally:
        first.pool = second.pool = None
        pool.close()


def test_one_api_server_without_a_pool_decodes_a_new_photo_as_it_comes(
        processor: Any, name: str, counted: list[int]) -> None:
    """One API server and no miss pool: a photo it has not loaded is new, decoded by vLLM's
    own load as it comes (on vLLM's media threads, not later on its multimodal thread); the
    same photo again is a hit, lazy and never decoded. With two API servers (above) every
    JPEG stays lazy: a photo new here may be another API server's hit."""
    from shmstore.vllm._accel import _images
    from shmstore.vllm._sender import ShmstoreSenderCache

    sender = ShmstoreSenderCache(shared.config(name, cache_mb=shared.cache_mb(), world_size=1))
    try:
        assert sender.pool is None and sender.accel.new_at_once
        for seed in range(3):
            data = jpeg(40 + seed)
            ids, places, _, _ = run(processor, data, None, counted)  # vLLM alone
            new = run(processor, data, sender, counted)
            assert new[:2] == (ids, places) and new[3] == 1
            assert not isinstance(new[2], LazyImage)  # decoded as it came, as vLLM decodes
            hit = run(processor, data, sender, counted)
            assert hit[:2] == (ids, places) and hit[3] == 0
            assert isinstance(hit[2], LazyImage) and not hit[2].realized  # never decoded
        assert sender.accel.skipped == {"decode": 3, "processor": 0}
        assert sender.store.stats().puts == 3
    finally:
        sender.close()
    assert not _images._NEW_AT_ONCE  # closed: the next sender decides afresh

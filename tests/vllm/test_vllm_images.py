"""Images decoded only when the processor needs them: vLLM's real ImageMediaIO, its hasher and
its media connector, against vLLM's own eager load_bytes on the same bytes. Whatever the bytes,
the lazy path must give vLLM's pixels, hash, size and error, or take vLLM's own path."""

from __future__ import annotations

import base64
import io
import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from PIL import Image
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.media.connector import MediaConnector
from vllm.multimodal.media.image import ImageMediaIO

from shmstore.vllm import _hooks, _scope
from shmstore.vllm._accel._images import LazyImage, lazy_loader, realize_misses, unrealized
from shmstore.vllm._sender import Processing

EAGER = ImageMediaIO.load_bytes
if getattr(EAGER, "_shmstore_hook", False):  # another test installed it: vLLM's is wrapped
    EAGER = EAGER.__wrapped__
LAZY = lazy_loader(EAGER)


def encoded(fmt: str = "JPEG", mode: str = "RGB", size: tuple[int, int] = (96, 64),
            orientation: int | None = None, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 255, (size[1], size[0], channels), dtype=np.uint8)
    image = Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)
    out = io.BytesIO()
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    image.save(out, format=fmt, exif=exif)
    return out.getvalue()


def outcome(load: Any, data: bytes, mode: str | None = "RGB") -> Any:
    """What a load gives once the processor reads it: (pixels, mode, size, hash) or the error."""
    try:
        media = load(ImageMediaIO(image_mode=mode), data)
        digest = MultiModalHasher.hash_kwargs("blake3", image=media)
        size = media.media.size
        if isinstance(media, LazyImage):
            media.realize()
        pixels = np.asarray(media.media)
        return pixels.tobytes(), media.media.mode, size, digest, media.io_config
    except Exception as exc:  # PIL names the stream it read by its address: not compared
        return type(exc).__name__, re.sub(r" at 0x[0-9a-f]+", " at 0x...", str(exc))


CASES = {
    "jpeg": encoded(),
    "jpeg-3mp": encoded(size=(2048, 1536)),
    "jpeg-rotated": encoded(orientation=6),
    "jpeg-orientation-1": encoded(orientation=1),
    "jpeg-grey": encoded(mode="L"),
    "png": encoded("PNG"),
    "png-rgba": encoded("PNG", "RGBA"),
    "webp": encoded("WEBP"),
    "truncated-jpeg": encoded(size=(256, 256))[:3000],
    "jpeg-header-only": encoded()[:200],
    "garbage": b"\xff\xd8\xff" + bytes(500),
    "empty": b"",
    "text": b"not an image at all",
}
LAZY_CASES = {"jpeg", "jpeg-3mp", "jpeg-orientation-1", "truncated-jpeg"}


@pytest.mark.parametrize("case", list(CASES))
def test_lazy_loading_gives_what_vllm_gives(case: str) -> None:
    data = CASES[case]
    assert outcome(LAZY, data) == outcome(EAGER, data)
    assert outcome(LAZY, data, mode=None) == outcome(EAGER, data, mode=None)
    try:
        loaded = LAZY(ImageMediaIO(), data)
    except ValueError:
        loaded = None
    assert isinstance(loaded, LazyImage) == (case in LAZY_CASES)
    if case == "truncated-jpeg":  # the header opens; the error comes with the decode
        with pytest.raises(ValueError, match="Failed to load image"):
            loaded.realize()


def test_an_image_over_vllms_pixel_limit_is_refused_as_vllm_refuses_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_MAX_IMAGE_PIXELS", 1000, raising=False)
    monkeypatch.setenv("VLLM_MAX_IMAGE_PIXELS", "1000")
    data = CASES["jpeg"]
    assert outcome(LAZY, data)[0] == "ValueError"
    assert outcome(LAZY, data) == outcome(EAGER, data)


def test_a_lazy_image_decodes_once_with_vllms_own_code() -> None:
    calls = []

    def counting(self: Any, data: bytes) -> Any:
        calls.append(len(data))
        return EAGER(self, data)

    media = lazy_loader(counting)(ImageMediaIO(), CASES["jpeg"])
    assert calls == [] and isinstance(media, LazyImage) and not media.realized
    media.realize()
    media.realize()
    assert calls == [len(CASES["jpeg"])] and media.realized


def test_data_urls_and_files_load_lazily_through_vllms_connector(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setattr(ImageMediaIO, "load_bytes", LAZY)
    data = CASES["jpeg"]
    connector = MediaConnector(allowed_local_media_path=str(tmp_path))
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    (tmp_path / "a.jpg").write_bytes(data)
    for media in (connector.fetch_image(url), connector.fetch_image(f"file://{tmp_path}/a.jpg")):
        assert isinstance(media, LazyImage) and not media.realized
        media.realize()
        assert np.array_equal(np.asarray(media.media), np.asarray(EAGER(ImageMediaIO(), data).media))


def budget_run(load: Any, urls: list[str]) -> tuple[Any, ...]:
    """Load one request's images through vLLM's connector with its per-request decoded-media
    budget (vLLM 0.33): which loaded, the refusal (vLLM's ValueError), the bytes charged, and
    the charge once every loaded image was decoded (a miss is; a hit never is)."""
    from vllm.multimodal.media.base import MediaDecodedBudget

    budget = MediaDecodedBudget()
    connector = MediaConnector(decoded_budget=budget)
    loaded, refusal = [], None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ImageMediaIO, "load_bytes", load)
        for url in urls:
            try:
                loaded.append(connector.fetch_image(url))
            except ValueError as exc:
                refusal = str(exc)
                break
        charged = budget.used
        for media in loaded:
            if isinstance(media, LazyImage):
                media.realize()
    pixels = [np.asarray(media.media).tobytes() for media in loaded]
    return len(loaded), refusal, charged, budget.used, pixels


@pytest.mark.skipif("decoded_budget" not in ImageMediaIO.__init__.__code__.co_varnames,
                    reason="this vLLM has no per-request decoded-media budget (0.33 has)")
@pytest.mark.parametrize("limit_images", [2.5, 3.0, 3.0 - 1e-6, 0.5, 10.0])
def test_lazy_images_are_charged_to_vllms_media_budget_as_vllm_charges_them(
        monkeypatch: pytest.MonkeyPatch, limit_images: float) -> None:
    import vllm.envs as envs

    size = (1024, 768)
    photos = [("jpeg", encoded(size=size, seed=1)), ("png", encoded("PNG", size=size, seed=2)),
              ("jpeg", encoded(size=size, seed=3))]  # lazy, vLLM's own path, lazy
    urls = [f"data:image/{kind};base64," + base64.b64encode(data).decode()
            for kind, data in photos]
    limit = int(limit_images * size[0] * size[1] * 4)
    monkeypatch.setattr(envs, "VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES", limit, raising=False)
    monkeypatch.setenv("VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES", str(limit))
    lazy, eager = budget_run(LAZY, urls), budget_run(EAGER, urls)
    assert lazy == eager  # refused at the same image, with vLLM's words, the same bytes charged
    count, refusal, charged, after_decode, _ = lazy
    assert count == min(3, int(limit_images + 1e-9))
    assert (refusal is None) == (count == 3)
    assert refusal is None or "VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES" in refusal
    assert charged == after_decode == count * size[0] * size[1] * 4  # a decode charges nothing more


def items(*media: Any) -> dict[str, Any]:
    """vLLM's MultiModalDataItems as the hooks see them: modality -> items with .data."""
    return {"image": SimpleNamespace(data=list(media)), "audio": SimpleNamespace(data=None)}


def test_the_processor_hooks_decode_the_misses_and_count_the_rest() -> None:
    """vLLM's step that finds the cached items asks the cache, then reads the misses: the
    hook lists the request's lazy images in the scope the sender's view carries, and
    is_cached's answer decodes the misses'. A cache that is not such a view decodes them all."""
    hooks = _hooks.wrappers()
    hit, miss, png = (LAZY(ImageMediaIO(), CASES["jpeg"]), LAZY(ImageMediaIO(), CASES["jpeg-3mp"]),
                      LAZY(ImageMediaIO(), CASES["png"]))
    seen = []
    view = Processing(SimpleNamespace(), _scope.RequestScope())  # the processor hook's

    def find_missing(self: Any, cache: Any, mm_data_items: Any, mm_hashes: Any) -> Any:
        cached = [h == "hit" for h in mm_hashes["image"]]
        if isinstance(cache, Processing):
            realize_misses(cache.scope.pending, mm_hashes["image"], cached)  # as is_cached does
        seen.append([getattr(d, "realized", None) for d in mm_data_items["image"].data])
        return cached, "missing"

    step = hooks["missing_items"](find_missing)
    assert step(None, cache=view, mm_data_items=items(hit, miss, png),
                mm_hashes={"image": ["hit", "miss", "png"]}) == ([True, False, False], "missing")
    assert seen == [[False, True, None]] and not hit.realized  # the hit never decoded
    assert unrealized(items(hit, miss, png)) == 1
    assert view.scope.pending == {}  # nothing pending after the step
    uncached = hooks["uncached_apply"](lambda self, inputs: "processed")
    assert uncached(None, SimpleNamespace(mm_data_items=items(hit))) == "processed"
    assert hit.realized
    other = LAZY(ImageMediaIO(), CASES["jpeg"])
    step(None, cache=None, mm_data_items=items(other), mm_hashes={"image": ["hit"]})
    assert seen[-1] == [True]  # not the sender's view: decoded before the step reads it
    broken = LAZY(ImageMediaIO(), CASES["truncated-jpeg"])
    with pytest.raises(ValueError, match="Failed to load image"):
        step(None, view, items(broken), {"image": ["broken"]})


def test_a_photo_is_seen_once_whatever_the_threads() -> None:
    """The guess of which photos are new (first sight) is thread-safe and bounded."""
    import threading

    from shmstore.vllm._accel._images import SeenPhotos

    seen = SeenPhotos(capacity=2)
    photos = [encoded(seed=s) for s in range(3)]
    firsts: list[bool] = []
    gate = threading.Barrier(8)

    def look() -> None:
        gate.wait()
        firsts.append(seen.first_sight(photos[0]))

    threads = [threading.Thread(target=look) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(firsts) == [False] * 7 + [True]
    assert seen.first_sight(photos[1]) and seen.first_sight(photos[2])  # photos[0] forgotten
    assert seen.first_sight(photos[0]) and not seen.first_sight(photos[2])
    assert seen.first_sight(photos[0][:-1] + b"\x00")  # one byte at the end differs: new


def test_new_photos_decode_at_once_only_while_a_sender_wants_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from shmstore.vllm._accel import _images

    monkeypatch.setattr(_images, "_SEEN", _images.SeenPhotos())
    data = encoded(seed=50)
    _images.decode_new_at_once(True)
    try:
        first, again = LAZY(ImageMediaIO(), data), LAZY(ImageMediaIO(), data)
    finally:
        _images.decode_new_at_once(False)
    assert not isinstance(first, LazyImage) and isinstance(again, LazyImage)
    assert outcome(LAZY, data) == outcome(EAGER, data)
    assert isinstance(LAZY(ImageMediaIO(), encoded(seed=51)), LazyImage)  # no one wants it


def test_a_lazy_image_is_hashed_once_however_often_its_request_asks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The miss pool's sender hashes a request's items, then vLLM's processor hashes them
    again: the second time is answered from the lazy image (its bytes never change), and
    only where the hash is of the item alone; every answer is vLLM's own hash."""
    from shmstore.vllm._accel import _images
    from shmstore.vllm._vllm import install_hash_memo

    install_hash_memo(_images._hashes_of)  # as a sender's install() does
    data = encoded(seed=5)
    lazy, eager = LAZY(ImageMediaIO(image_mode="RGB"), data), EAGER(ImageMediaIO(image_mode="RGB"), data)
    assert isinstance(lazy, LazyImage) and not isinstance(eager, LazyImage)
    hashed: list[str] = []
    walk = MultiModalHasher.iter_item_to_bytes.__func__

    def counting(cls: Any, key: str, obj: object) -> Any:
        if obj is lazy:
            hashed.append(key)
        return walk(cls, key, obj)

    monkeypatch.setattr(MultiModalHasher, "iter_item_to_bytes", classmethod(counting))

    def both(algorithm: str = "blake3", **kwargs: Any) -> tuple[str, str]:
        return (MultiModalHasher.hash_kwargs(algorithm, **kwargs, image=lazy),
                MultiModalHasher.hash_kwargs(algorithm, **kwargs, image=eager))

    for _ in range(3):
        mine, vllms = both(model_id="m")
        assert mine == vllms
    assert hashed == ["image"]  # once for three asks
    for algorithm, kwargs in (("blake3", {"model_id": "other"}), ("sha256", {"model_id": "m"})):
        mine, vllms = both(algorithm, **kwargs)  # another model or algorithm: its own hash
        assert mine == vllms and both(algorithm, **kwargs)[0] == mine
    assert len(hashed) == 3
    for _ in range(2):  # another factor in the hash: hashed each time, as vLLM hashes it
        mine, vllms = both(model_id="m", mm_processor_kwargs={"num_crops": 4})
        assert mine == vllms
    assert len(hashed) == 5

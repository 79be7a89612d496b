"""Images decoded only when the processor needs them: a hit never decodes its image.

vLLM keys an image on a hash of its original bytes (MediaWithBytes.original_bytes) and a hit
never looks at the pixels, yet ImageMediaIO.load_bytes decodes every image as it arrives (1.5 ms
for 0.3 MP, 14 ms for 3 MP). In an API process with shmstore's sender, load_bytes reads only the
header of a JPEG that needs no conversion (its mode is the one asked for, no EXIF rotation, not
over VLLM_MAX_IMAGE_PIXELS) and returns a LazyImage: the header image (size, mode, EXIF: all
the hash and the parser read) and the bytes. vLLM reads a request's items for its processor
right after asking the cache which are cached: the hook around that step lists the request's
lazy images by hash (`pending`), and the sender's is_cached calls `realize()` on the misses
(`realize_misses`) before it returns: vLLM's own load_bytes on the same bytes, so the pixels,
the errors ("Failed to load image: ...", a 400 for the client) and the mode are vLLM's.
Anything else (PNG, a rotated or grey JPEG, bytes whose header does not open) takes vLLM's
own path at once. Code outside the processor that reads a lazy image's pixels gets PIL's
decode of the same bytes on first use: the same pixels (nothing converts or rotates them).
Without a miss pool, and with one API server (whose store holds only what it stored), a JPEG
this process has not loaded before is new: it is decoded at once by vLLM's own load_bytes,
where vLLM decodes it (its media threads), so new photos do not queue their decodes on the one
multimodal thread; a JPEG it has loaded before stays lazy (`decode_new_at_once`). A photo
seen before but evicted since is decoded lazily on a miss, as every photo is otherwise.
vLLM 0.33 charges each image's decoded size (width x height x 4, from the header) to the
request's budget before decoding: a lazy image is charged the same, when it is loaded, hit,
pool item or miss alike, and its later decode is not charged again.
"""

from __future__ import annotations

import functools
import io
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._vllm import (
    MediaWithBytes,
    charge_decoded,
    install_hash_memo,
    install_image_loader,
    io_settings,
    items_data,
    max_image_pixels,
    open_image,
)

__all__ = ["LazyImage", "lazy_loader", "install", "release", "realize", "unrealized",
           "pending", "realize_misses", "decode_new_at_once", "SeenPhotos"]

ORIENTATION = 0x0112  # the EXIF tag vLLM's exif_transpose acts on (values 2..8 rotate)


class Wanted:
    """How many of this process's senders want a way of loading: on while any does (a sender
    says so when it opens and again when it closes)."""

    def __init__(self) -> None:
        self.senders = 0

    def __bool__(self) -> bool:
        return self.senders > 0

    def say(self, on: bool) -> None:
        self.senders = max(0, self.senders + (1 if on else -1))


_LAZY = Wanted()  # images lazy (install/release)
_NEW_AT_ONCE = Wanted()  # of those, a photo not seen before decoded at once
SEEN_PHOTOS = 1 << 16  # photos remembered as seen (about 125 bytes each: 8 MB in all)
SAMPLE_BYTES = 4096  # a photo is known by its size and its first and last bytes


class SeenPhotos:
    """The photos this process has loaded, by their size and first and last bytes (a guess
    of which are stored, never used to read anything: a wrong guess only moves a decode)."""

    def __init__(self, capacity: int = SEEN_PHOTOS) -> None:
        self._capacity = capacity
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()  # vLLM loads media on several threads

    def first_sight(self, data: bytes) -> bool:
        """Whether `data` was not seen before (it is remembered from now on)."""
        mark = hash((len(data), data[:SAMPLE_BYTES], data[-SAMPLE_BYTES:]))
        with self._lock:
            if mark in self._seen:
                self._seen.move_to_end(mark)
                return False
            self._seen[mark] = None
            if len(self._seen) > self._capacity:
                self._seen.popitem(last=False)
            return True


_SEEN = SeenPhotos()


def decode_new_at_once(on: bool) -> None:
    """One sender of this process wants (on) or no longer wants (off) a photo this process has
    not loaded before decoded at once (counted, as install/release)."""
    _NEW_AT_ONCE.say(on)


class LazyImage(MediaWithBytes):  # type: ignore[misc]
    """A MediaWithBytes whose media is the image's header until `realize()`."""

    def realize(self) -> None:
        """Decode with vLLM's own load_bytes (its errors raised as they are); idempotent."""
        decode = self.__dict__.pop("_decode", None)
        if decode is not None:
            decoded = decode()
            self.media, self.io_config = decoded.media, decoded.io_config

    @property
    def settings(self) -> tuple[str | None, dict[str, Any]]:
        """The (image_mode, kwargs) of the ImageMediaIO that loaded it (load_image loads alike)."""
        return self.__dict__["_settings"]  # type: ignore[no-any-return]

    @property
    def realized(self) -> bool:
        return "_decode" not in self.__dict__


def lazy_loader(original: Callable[[Any, bytes], Any]) -> Callable[[Any, bytes], Any]:
    """ImageMediaIO.load_bytes made lazy where that changes nothing but when pixels are made."""

    @functools.wraps(original)
    def load_bytes(self: Any, data: bytes) -> Any:
        header = _header(data)
        if header is None or not _needs_no_conversion(header, self.image_mode):
            return original(self, data)
        if _NEW_AT_ONCE and _SEEN.first_sight(data):
            return original(self, data)  # new: decoded here, as vLLM decodes it
        decoder = charge_decoded(self, *header.size)  # 0.33's budget, charged now as vLLM does
        media = LazyImage(header, data, None)
        media.__dict__["_decode"] = functools.partial(original, decoder, data)
        media.__dict__["_settings"] = io_settings(self)
        return media
    return load_bytes


def install() -> bool:
    """Make this process's image loading lazy until `release` (counted: lazy while any sender
    that installed it is open); False where this vLLM cannot. A lazy image keeps its hash: the
    miss pool's sender hashes a request's items, then vLLM's processor asks again."""
    if not install_image_loader(_while_wanted):
        return False
    install_hash_memo(_hashes_of)
    _LAZY.say(True)
    return True


def _hashes_of(item: Any) -> dict[Any, str] | None:
    """Where a lazy image keeps its hashes (its bytes never change); None for anything else."""
    if type(item) is not LazyImage:
        return None
    return item.__dict__.setdefault("_hashes", {})  # type: ignore[no-any-return]


def release() -> None:
    """One sender that installed lazy loading closed (its acceleration is over): loading is
    vLLM's own again once no sender wants it lazy."""
    _LAZY.say(False)


def _while_wanted(original: Callable[[Any, bytes], Any]) -> Callable[[Any, bytes], Any]:
    """vLLM's load_bytes, lazy while a sender of this process wants it (`install`)."""
    lazy = lazy_loader(original)

    @functools.wraps(original)
    def load_bytes(self: Any, data: bytes) -> Any:
        return lazy(self, data) if _LAZY else original(self, data)
    return load_bytes


def _header(data: bytes) -> Any:
    try:
        return open_image(io.BytesIO(data))
    except Exception:  # vLLM's own path says what is wrong with it
        return None


def _needs_no_conversion(image: Any, mode: str | None) -> bool:
    """Whether vLLM's load_bytes would return these pixels as the decoder makes them."""
    if image.format != "JPEG" or (mode is not None and image.mode != mode):
        return False
    width, height = image.size
    limit = max_image_pixels()
    if limit > 0 and width * height > limit:
        return False  # vLLM's path refuses it
    try:
        orientation = image.getexif().get(ORIENTATION, 1)
    except Exception:
        return False
    return orientation not in range(2, 9)


def _lazy_images(items: Any) -> Iterable[LazyImage]:
    """The LazyImages among vLLM's MultiModalDataItems (modality -> items with .data)."""
    for modality_items in (items or {}).values():
        data = items_data(modality_items)
        if isinstance(data, list):
            yield from (d for d in data if isinstance(d, LazyImage))


def pending(items: Any, hashes: Any) -> dict[str, list[LazyImage]]:
    """vLLM is about to ask the cache which of `items` (by modality, with `hashes` by
    modality) are cached: their lazy images not decoded yet, by hash (for realize_misses)."""
    found: dict[str, list[LazyImage]] = {}
    for modality, modality_hashes in (hashes or {}).items():
        data = items_data((items or {}).get(modality))
        if isinstance(data, list) and len(data) == len(modality_hashes):
            for mm_hash, item in zip(modality_hashes, data, strict=True):
                if isinstance(item, LazyImage) and not item.realized:
                    found.setdefault(mm_hash, []).append(item)
    return found


def realize_misses(found: dict[str, list[LazyImage]], hashes: Sequence[str],
                   cached: Sequence[bool]) -> None:
    """Decode the lazy images in `found` (a request scope's pending ones) of the hashes that
    are not cached (vLLM reads them for its processor next); vLLM's error for an image it
    cannot decode is raised here."""
    if found:
        for mm_hash, hit in zip(hashes, cached, strict=True):
            if not hit:
                for image in found.pop(mm_hash, ()):
                    image.realize()


def realize(items: Any) -> None:
    """Decode every lazy image among `items` (the processor is about to read them)."""
    for image in _lazy_images(items):
        image.realize()


def unrealized(items: Any) -> int:
    """How many images among `items` were never decoded."""
    return sum(not image.realized for image in _lazy_images(items))

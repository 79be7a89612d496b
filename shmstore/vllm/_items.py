"""vLLM's multimodal items as values shmstore's serializer carries, and the handle items that
replace them on the way to the workers.

The handle item carries an `address` field (vLLM keeps items with one when prefix caching strips
covered data, so every hand-out reaches the workers and is counted) and `shmstore_handle`, the
Handle's fields and the object's origin seq as six ints (they survive vLLM's msgpack round
trip; the origin seq lets a worker on another node find its relay's copy).
"""

from __future__ import annotations

from typing import Any

from ..errors import (
    CorruptObject,
    InvalidHandle,
)
from ..handle import Handle
from ._vllm import (
    MultiModalBatchedField,
    MultiModalFieldConfig,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalSharedField,
)

__all__ = ["HANDLE_FIELD", "HANDLE_WORDS", "item_to_value", "value_to_item", "handle_item",
           "handout_number", "object_id_from_item", "handle_from_item"]


HANDLE_FIELD = "shmstore_handle"
HANDLE_WORDS = 7  # address, seq, key digest (2 words), epoch, origin seq, hand-out number
_FIELD_KINDS = {MultiModalFlatField: "flat", MultiModalSharedField: "shared",
                MultiModalBatchedField: "batched"}


def _slices_out(slices: Any) -> Any:
    if isinstance(slices, slice):
        return [slices.start, slices.stop, slices.step]
    return [_slices_out(s) for s in slices]


def _slices_in(obj: Any) -> Any:
    if obj and not isinstance(obj[0], list):
        return slice(*obj)
    return [_slices_in(s) for s in obj]


def item_to_value(item: MultiModalKwargsItem) -> dict[str, Any]:
    """A MultiModalKwargsItem as plain values and tensors (no pickle)."""
    fields = {}
    for key, elem in item.items():
        field = elem.field
        kind = _FIELD_KINDS.get(type(field))
        if kind is None:
            raise TypeError(f"field {key!r} of type {type(field).__name__} is not supported")
        options: dict[str, Any] = {"keep_on_cpu": bool(field.keep_on_cpu)}
        if kind == "flat":
            options["slices"] = _slices_out(field.slices)
            options["dim"] = int(field.dim)
        elif kind == "shared":
            options["batch_size"] = int(field.batch_size)
        fields[key] = [kind, options, elem.data]
    return {"fields": fields}


def value_to_item(value: Any) -> MultiModalKwargsItem:
    """The inverse of item_to_value; CorruptObject if `value` is not what it makes."""
    try:
        elems = {}
        for key, (kind, options, data) in value["fields"].items():
            if kind not in ("flat", "shared", "batched") or not isinstance(options, dict):
                raise ValueError(f"field kind {kind!r}")
            options = dict(options)
            if kind == "flat":
                options["slices"] = _slices_in(options["slices"])
            field = getattr(MultiModalFieldConfig, kind)("", **options).field
            elems[key] = MultiModalFieldElem(data=data, field=field)
        return MultiModalKwargsItem(elems)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptObject(f"stored vLLM item is not valid: {type(exc).__name__}: {exc}") from None


def handle_item(handle: Handle, object_id: bytes, number: int) -> MultiModalKwargsItem:
    """The item a worker gets instead of the data: `handle`, the object's id, and the number of
    this hand-out (a worker counts each hand-out it reads for a request once)."""
    words = [handle.address, handle.seq, int.from_bytes(handle.key_digest[:8], "little"),
             int.from_bytes(handle.key_digest[8:], "little"), handle.epoch,
             int.from_bytes(object_id[16:], "little"), number]
    batched = MultiModalBatchedField()
    return MultiModalKwargsItem({
        "address": MultiModalFieldElem(data=handle.address, field=batched),
        HANDLE_FIELD: MultiModalFieldElem(data=words, field=batched),
    })


def _words(item: Any) -> list[int] | None:
    if item is None or HANDLE_FIELD not in item:
        return None
    words = item[HANDLE_FIELD].data
    if (not isinstance(words, (list, tuple)) or len(words) != HANDLE_WORDS
            or any(type(w) is not int or not 0 <= w < 1 << 64 for w in words)):
        raise ValueError(f"malformed shmstore handle item: expected {HANDLE_WORDS} unsigned "
                         "64-bit ints")
    return list(words)


def handout_number(item: Any) -> int | None:
    """The hand-out number a handle item carries, None for an item with data or anything that
    is not a well-formed handle item."""
    try:
        words = _words(item) if isinstance(item, MultiModalKwargsItem) else None
    except ValueError:
        return None
    return None if words is None else words[6]


def object_id_from_item(item: Any) -> bytes | None:
    """The object id (key digest + origin seq) a handle item names, None for an item with
    data; ValueError if it is malformed."""
    words = _words(item)
    if words is None:
        return None
    return b"".join(w.to_bytes(8, "little") for w in (words[2], words[3], words[5]))


def handle_from_item(item: Any) -> Handle | None:
    """The Handle an item carries, None for an item with data; ValueError if it is malformed."""
    words = _words(item)
    if words is None:
        return None
    address, seq, low, high, epoch, _, _ = words
    try:
        return Handle(address, seq, low.to_bytes(8, "little") + high.to_bytes(8, "little"), epoch)
    except (InvalidHandle, ValueError, TypeError) as exc:
        raise ValueError(f"malformed shmstore handle item: {exc}") from None

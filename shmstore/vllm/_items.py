"""vLLM's multimodal items as values shmstore's serializer carries, and the handle items that
replace them on the way to the workers.

The handle item carries an `address` field (vLLM keeps items with one when prefix caching strips
covered data, so every hand-out reaches the workers and is counted) and `shmstore_handle`: one
HandOut in its word form (HandOut.to_words: handle, number, object id as nine ints, which
survive vLLM's msgpack round trip; the object id lets a worker on another node find its relay's
copy). `handle_item` writes them and `handout_from_item` reads them back (HandOut.from_words).
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptObject, InvalidHandle
from ..handle import HandOut
from ._vllm import (
    MultiModalBatchedField,
    MultiModalFieldConfig,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalSharedField,
)

__all__ = ["HANDLE_FIELD", "item_to_value", "value_to_item", "handle_item",
           "handout_from_item", "handout_number"]


HANDLE_FIELD = "shmstore_handle"
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


def handle_item(handout: HandOut) -> MultiModalKwargsItem:
    """The item a worker gets instead of the data: one hand-out (a worker counts each hand-out
    it reads for a request once)."""
    batched = MultiModalBatchedField()
    return MultiModalKwargsItem({
        "address": MultiModalFieldElem(data=handout.handle.address, field=batched),
        HANDLE_FIELD: MultiModalFieldElem(data=list(handout.to_words()), field=batched),
    })


def handout_from_item(item: Any) -> HandOut | None:
    """The HandOut a handle item carries, None for an item with data; ValueError if it is
    malformed."""
    if item is None or HANDLE_FIELD not in item:
        return None
    try:
        return HandOut.from_words(item[HANDLE_FIELD].data)
    except InvalidHandle as exc:  # a ValueError
        raise ValueError(f"malformed shmstore handle item: {exc}") from None


def handout_number(item: Any) -> int | None:
    """The hand-out number a handle item carries, None for an item with data or anything that
    is not a well-formed handle item."""
    try:
        found = handout_from_item(item) if isinstance(item, MultiModalKwargsItem) else None
    except ValueError:
        return None
    return None if found is None else found.number

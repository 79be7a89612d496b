"""An item's resolved prompt updates as a small msgpack record stored beside its tensors, so
that any API server of the node can use a stored item without running the HF processor.

A resolved prompt update is token ids plus closures that vLLM makes only through its own
factories (`PromptIndexTargets.start/end/prefix`, `PromptUpdateDetails.select_token_id(s)`).
The record names the factory and its token ids; reading calls the same factory again. An
update made any other way (a model's own lambda) has no record: such items are not shared,
each API server runs the processor as vLLM does.

    record   [RECORD_VERSION, fingerprint (16 bytes), [update, ...]]
    update   [modality, item index, mode, target, full, embed]
    target   [SEQ, runs] | [START] | [END] | [PREFIX, runs]
    full     runs                  the content's token ids
    embed    None | [ONE, id] | [ANY, [ids]]
    runs     [token, count, token, count, ...]   (placeholders are long runs of one token)

The record sits in the object's msgpack structure, behind the store's CRC; `read` still checks
every type, bound and length, and the fingerprint (vLLM version, model, processor config, the
request's processor kwargs) must be this server's. Anything else is refused with a reason and
the processor runs: never a wrong token.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgpack

from ...handle import MAX_RECORD_BYTES
from .._vllm import (
    FACTORY_CODES,
    PromptIndexTargets,
    PromptUpdateDetails,
    ResolvedPromptUpdate,
    UpdateMode,
    records_supported,
)

__all__ = ["RECORD_FIELD", "RECORD_VERSION", "FINGERPRINT_BYTES", "RecordRefused", "write",
           "read"]

RECORD_FIELD = "vllm_updates"  # the item value's field (store.peek_cached reads it)
RECORD_VERSION = 1
FINGERPRINT_BYTES = 16
MAX_UPDATES = 16  # per item
MAX_RUNS = 256  # per token sequence
MAX_TOKENS = 1 << 20  # a token sequence, expanded
MAX_EMBED_IDS = 64
MAX_ITEM_INDEX = 1 << 20
SEQ, START, END, PREFIX = 0, 1, 2, 3
ONE, ANY = 0, 1
_MODES = {UpdateMode.INSERT: "insert", UpdateMode.REPLACE: "replace"}
_MODE_OF = {name: mode for mode, name in _MODES.items()}
_MODALITY = re.compile(r"[a-z][a-z0-9_]{0,31}")


class RecordRefused(Exception):
    """A record that cannot be used; `reason` is the metric label (missing, version,
    fingerprint, damaged)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# -- writing -----------------------------------------------------------------------------------

def write(updates: Sequence[Any], fingerprint: bytes) -> bytes | None:
    """The record of an item's resolved prompt updates; None when one of them was not made by
    vLLM's factories (or the record would be over MAX_RECORD_BYTES): the item is not shared."""
    if not records_supported() or len(updates) > MAX_UPDATES:
        return None
    out = []
    for update in updates:
        encoded = _update_out(update)
        if encoded is None:
            return None
        out.append(encoded)
    record = msgpack.packb([RECORD_VERSION, fingerprint, out], use_bin_type=True)
    return record if len(record) <= MAX_RECORD_BYTES else None


def _update_out(update: Any) -> list[Any] | None:
    if type(update) is not ResolvedPromptUpdate or update.mode not in _MODES:
        return None
    target, content = _target_out(update.target), _content_out(update.content)
    if (target is None or content is None or type(update.modality) is not str
            or not _MODALITY.fullmatch(update.modality) or type(update.item_idx) is not int):
        return None
    return [update.modality, update.item_idx, _MODES[update.mode], target, *content]


def _target_out(target: Any) -> list[Any] | None:
    if type(target) is list:
        runs = _runs_out(target)
        return None if runs is None else [SEQ, runs]
    codes = _codes(getattr(target, "get_match_index", None),
                   getattr(target, "get_text_match_index", None))
    if codes == FACTORY_CODES["start"]:
        return [START]
    if codes == FACTORY_CODES["end"]:
        return [END]
    if codes == FACTORY_CODES["prefix"]:
        seq = _closure(target.get_match_index, "seq")
        if seq is not _closure(target.get_text_match_index, "seq") or type(seq) is not list:
            return None
        runs = _runs_out(seq)
        return None if runs is None else [PREFIX, runs]
    return None


def _content_out(content: Any) -> tuple[list[int], list[Any] | None] | None:
    if type(content) is not PromptUpdateDetails or type(content.full) is not list:
        return None
    full = _runs_out(content.full)
    if full is None:
        return None
    is_embed = content.is_embed
    if is_embed is None:
        return full, None
    code = _codes(is_embed)
    if code == FACTORY_CODES["select_token_id"]:
        token = _closure(is_embed, "embed_token_id")
        return (full, [ONE, token]) if _is_token(token) else None
    if code == FACTORY_CODES["select_token_ids"]:
        tokens = _closure(is_embed, "embed_token_ids")
        if (type(tokens) is list and len(tokens) <= MAX_EMBED_IDS
                and all(_is_token(t) for t in tokens)):
            return full, [ANY, list(tokens)]
    return None


def _codes(*functions: Any) -> tuple[Any, ...] | None:
    codes = tuple(getattr(f, "__code__", None) for f in functions)
    return None if None in codes else codes


def _closure(function: Any, name: str) -> Any:
    names = function.__code__.co_freevars
    if name not in names or function.__closure__ is None:
        return None
    return function.__closure__[names.index(name)].cell_contents


def _is_token(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 31


def _runs_out(tokens: list[Any]) -> list[int] | None:
    if len(tokens) > MAX_TOKENS or not all(_is_token(t) for t in tokens):
        return None
    runs: list[int] = []
    for token in tokens:
        if runs and runs[-2] == token:
            runs[-1] += 1
        else:
            if len(runs) == 2 * MAX_RUNS:
                return None
            runs += [token, 1]
    return runs


# -- reading -----------------------------------------------------------------------------------

def read(record: bytes | None, fingerprint: bytes, vocab_size: int) -> list[Any]:
    """The resolved prompt updates a record names, rebuilt with vLLM's own factories.

    Raises:
        RecordRefused: missing (no record), version (another record format), fingerprint
            (made for another model, processor or request kwargs), damaged (anything that
            is not exactly what `write` makes, or a token id outside the vocabulary).
    """
    if record is None:
        raise RecordRefused("missing", "the stored item has no prompt-update record")
    if not records_supported():
        raise RecordRefused("version", "this vLLM's prompt updates have other fields")
    try:
        head = msgpack.unpackb(record, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several kinds on bad bytes
        raise RecordRefused("damaged", f"not msgpack ({type(exc).__name__})") from None
    if type(head) is not list or len(head) != 3:
        raise RecordRefused("damaged", "not [version, fingerprint, updates]")
    version, found, updates = head
    if type(version) is not int or version != RECORD_VERSION:
        raise RecordRefused("version", f"record version {version!r}, not {RECORD_VERSION}")
    if type(found) is not bytes or len(found) != FINGERPRINT_BYTES:
        raise RecordRefused("damaged", "the fingerprint is not 16 bytes")
    if found != fingerprint:
        raise RecordRefused("fingerprint", "made for another model, processor or kwargs")
    if type(updates) is not list or len(updates) > MAX_UPDATES:
        raise RecordRefused("damaged", f"not a list of at most {MAX_UPDATES} updates")
    limit = vocab_size if vocab_size > 0 else 1 << 31
    return [_update_in(u, limit) for u in updates]


def _damaged(why: str) -> RecordRefused:
    return RecordRefused("damaged", why)


def _update_in(update: Any, limit: int) -> Any:
    if type(update) is not list or len(update) != 6:
        raise _damaged("an update is not a list of 6")
    modality, item_idx, mode, target, full, embed = update
    if type(modality) is not str or not _MODALITY.fullmatch(modality):
        raise _damaged("modality")
    if type(item_idx) is not int or not 0 <= item_idx < MAX_ITEM_INDEX:
        raise _damaged("item index")
    if type(mode) is not str or mode not in _MODE_OF:
        raise _damaged("mode")
    content = PromptUpdateDetails.from_seq(_runs_in(full, limit))
    if embed is not None:
        if type(embed) is not list or len(embed) != 2 or embed[0] not in (ONE, ANY):
            raise _damaged("embed")
        if embed[0] == ONE:
            content = PromptUpdateDetails.select_token_id(content.full, _token_in(embed[1], limit))
        else:
            ids = embed[1]
            if type(ids) is not list or not 0 < len(ids) <= MAX_EMBED_IDS:
                raise _damaged("embed ids")
            content = PromptUpdateDetails.select_token_ids(
                content.full, [_token_in(t, limit) for t in ids])
    return ResolvedPromptUpdate(modality=modality, item_idx=item_idx, mode=_MODE_OF[mode],
                                target=_target_in(target, limit), content=content)


def _target_in(target: Any, limit: int) -> Any:
    if type(target) is not list or not target or type(target[0]) is not int:
        raise _damaged("target")
    kind = target[0]
    if kind in (START, END) and len(target) == 1:
        return PromptIndexTargets.start() if kind == START else PromptIndexTargets.end()
    if kind in (SEQ, PREFIX) and len(target) == 2:
        tokens = _runs_in(target[1], limit)
        return tokens if kind == SEQ else PromptIndexTargets.prefix(tokens)
    raise _damaged("target kind")


def _token_in(value: Any, limit: int) -> int:
    if type(value) is not int or not 0 <= value < limit:
        raise _damaged(f"token id {value!r} outside the vocabulary")
    return value


def _runs_in(runs: Any, limit: int) -> list[int]:
    if type(runs) is not list or len(runs) % 2 or len(runs) > 2 * MAX_RUNS:
        raise _damaged("token runs")
    tokens: list[int] = []
    for i in range(0, len(runs), 2):
        token, count = _token_in(runs[i], limit), runs[i + 1]
        if type(count) is not int or not 0 < count <= MAX_TOKENS - len(tokens):
            raise _damaged("a run's count")
        tokens += [token] * count
    return tokens

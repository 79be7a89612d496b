"""Prompt-update records: an item's resolved prompt updates stored beside its tensors, so a hit
on another API server's item runs no HF processor there. Updates are made by vLLM's own
factories as its models make them; two API servers share one store as in test_vllm_shared.py.
A record that is missing, damaged, forged or made for other kwargs must never be used."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.multimodal.processing import PromptIndexTargets, PromptUpdateDetails  # noqa: E402
from vllm.multimodal.processing.processor import (  # noqa: E402
    PromptInsertion,
    PromptReplacement,
    ResolvedPromptUpdate,
)

from shmstore.vllm._accel import _records  # noqa: E402
from shmstore.vllm._accel._records import RECORD_FIELD, RecordRefused  # noqa: E402
from shmstore.vllm._items import handout_from_item, item_to_value  # noqa: E402
from shmstore.vllm._sender import Processing, ShmstoreSenderCache  # noqa: E402
from tests.vllm import test_vllm_shared as shared  # noqa: E402
from tests.vllm.test_vllm_plugin import image_item, same_item  # noqa: E402

node, segment_name, read = shared.node, shared.segment_name, shared.read  # its fixtures too

FP = bytes(range(16))
VOCAB = 32064
IMAGE, START, END = 32000, 32001, 32002


def families() -> dict[str, list[Any]]:
    """Resolved updates as vLLM's model processors make them (their shapes, these ids)."""
    return {
        "llava": [PromptReplacement("image", [IMAGE], [IMAGE] * 576).resolve(0)],
        "llava-next": [PromptReplacement(
            "image", [IMAGE], lambda i: PromptUpdateDetails.select_token_id(
                [IMAGE] * 1176 + [13] * 3, IMAGE)).resolve(1)],
        "qwen2-vl": [PromptReplacement(
            "image", [START, IMAGE, END], PromptUpdateDetails.select_token_id(
                [START] + [IMAGE] * 1296 + [END], IMAGE)).resolve(0)],
        "prefix-insert": [PromptInsertion("image", PromptIndexTargets.prefix([1, 2]),
                                          PromptUpdateDetails.select_token_ids(
                                              [START, IMAGE, IMAGE, END], [IMAGE, END])
                                          ).resolve(2)],
        "start-end": [PromptInsertion("audio", PromptIndexTargets.start(), [7, 7]).resolve(0),
                      PromptInsertion("audio", PromptIndexTargets.end(), [8]).resolve(0)],
    }


def behaves_alike(a: ResolvedPromptUpdate, b: ResolvedPromptUpdate) -> bool:
    """Same fields, and the closures answer alike on prompts that do and do not match."""
    if (a.modality, a.item_idx, a.mode, a.content.full) != (
            b.modality, b.item_idx, b.mode, b.content.full):
        return False
    if isinstance(a.target, list):
        if a.target != b.target:
            return False
    else:
        for prompt in ([1, 2, 3], [2, 1], [], [1, 2]):
            if (a.target.get_match_index(prompt) != b.target.get_match_index(prompt)
                    or a.target.get_match_index(prompt, 1) != b.target.get_match_index(prompt, 1)):
                return False
    if (a.content.is_embed is None) != (b.content.is_embed is None):
        return False
    if a.content.is_embed is not None:
        full = a.content.full + [IMAGE, END, 5]
        return bool(torch.equal(a.content.is_embed(full), b.content.is_embed(full)))
    return True


@pytest.mark.parametrize("family", list(families()))
def test_a_record_rebuilds_updates_that_behave_as_the_processors(family: str) -> None:
    updates = families()[family]
    record = _records.write(updates, FP)
    assert record is not None and len(record) < 100  # runs, not 1,298 token ids
    rebuilt = _records.read(record, FP, VOCAB)
    assert len(rebuilt) == len(updates)
    assert all(behaves_alike(a, b) for a, b in zip(updates, rebuilt, strict=True))


def test_updates_vllm_did_not_make_have_no_record() -> None:
    own_embed = PromptReplacement("image", [IMAGE], PromptUpdateDetails(
        full=[IMAGE] * 4, is_embed=lambda full: torch.ones(len(full), dtype=torch.bool))
                                  ).resolve(0)
    own_target = ResolvedPromptUpdate(
        modality="image", item_idx=0, mode=families()["llava"][0].mode,
        target=type(PromptIndexTargets.start())(lambda p, s=0: 3, lambda t, p, s=0: 3),
        content=PromptUpdateDetails.from_seq([IMAGE]))
    many_runs = PromptReplacement("image", [IMAGE], list(range(2 * 300))).resolve(0)
    for updates in ([own_embed], [own_target], [many_runs], ["u"], [families()["llava"][0]] * 17):
        assert _records.write(updates, FP) is None


def test_every_refusal_names_its_reason() -> None:
    record = _records.write(families()["qwen2-vl"], FP)
    assert record is not None
    cases = {
        "missing": None,
        "fingerprint": (record, bytes(16)),
        "version": msgpack.packb([2, FP, []]),
        "damaged": msgpack.packb([1, FP[:8], []]),
    }
    for reason, case in cases.items():
        data, fingerprint = case if isinstance(case, tuple) else (case, FP)
        with pytest.raises(RecordRefused) as refused:
            _records.read(data, fingerprint, VOCAB)
        assert refused.value.reason == reason
    outside = msgpack.packb([1, FP, [["image", 0, "replace", [0, [VOCAB, 1]], [1, 1], None]]])
    with pytest.raises(RecordRefused, match="vocabulary"):
        _records.read(outside, FP, VOCAB)
    for bad in ([["image", True, "replace", [0, [1, 1]], [1, 1], None]],  # bool, not int
                [["IMAGE", 0, "replace", [0, [1, 1]], [1, 1], None]],
                [["image", 0, "swap", [0, [1, 1]], [1, 1], None]],
                [["image", 0, "replace", [9], [1, 1], None]],
                [["image", 0, "replace", [0, [1, 0]], [1, 1], None]],  # a run of 0
                [["image", 0, "replace", [0, [1, 1 << 21]], [1, 1], None]],  # too long
                [["image", 0, "replace", [0, [1]], [1, 1], None]],
                [["image", 0, "replace", [0, [1, 1]], [1, 1], [0, -1]]],
                [["image", 0, "replace", [0, [1, 1]], [1, 1], [1, []]]]):
        with pytest.raises(RecordRefused) as refused:
            _records.read(msgpack.packb([1, FP, bad]), FP, VOCAB)
        assert refused.value.reason == "damaged"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_mutated_record_is_refused_or_well_formed_never_an_error(data: Any) -> None:
    """The store's CRC stands in front of the record; behind it, whatever bytes come, read()
    raises RecordRefused or returns updates vLLM's own factories made: nothing else."""
    record = _records.write(families()[data.draw(st.sampled_from(list(families())))], FP)
    assert record is not None
    mutated = bytearray(record)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(mutated) - 1))
        mutated[at] = data.draw(st.integers(0, 255))
    try:
        updates = _records.read(bytes(mutated), FP, VOCAB)
    except RecordRefused:
        return
    assert all(type(u) is ResolvedPromptUpdate for u in updates)


def test_every_byte_of_a_record_damaged_in_the_store_falls_back(node: Any) -> None:
    """One byte of the stored record changed in shared memory, each position in turn: the
    other API server never uses it (the CRC fails: not handed out, the processor runs)."""
    (first, second), receivers = node
    updates = families()["llava"]
    try:
        with processing(first, {}) as p1, processing(second, {}) as p2:
            p1.get_and_update_item((image_item(3), updates), "h3")
            record = _records.write(updates, _fingerprint(p1))
            entry = first.store._index.by_key["h3"]
            body = first.store._writer_ring.payload(entry.chunk)[first.store._header_bytes:]
            assert record is not None
            at = bytes(body[:4096]).index(record)
            for i in range(len(record)):
                body[at + i] ^= 0x41
                assert p2.is_cached(["h3"]) == [False]
                body[at + i] ^= 0x41
            assert p2.is_cached(["h3"]) == [True]  # intact again: a hit
    finally:
        second.release_sender_touches()


@contextmanager
def processing(sender: ShmstoreSenderCache, kwargs: dict[str, Any]) -> Iterator[Processing]:
    """The sender as vLLM's processor sees it in one request's processing with `kwargs` (what
    the processor hook passes in the request's ProcessorInputs)."""
    with sender.processing(SimpleNamespace(cache=sender), kwargs, None) as inputs:
        assert isinstance(inputs.cache, Processing) and inputs.cache.sender is sender
        yield inputs.cache


def _fingerprint(view: Processing) -> bytes:
    """The fingerprint of a request's processing scope."""
    assert view.scope.fingerprint is not None
    return view.scope.fingerprint


def test_another_api_servers_item_is_a_hit_without_the_processor(node: Any) -> None:
    (first, second), receivers = node
    updates = families()["llava-next"]
    with processing(first, {"size": 336}) as p1, processing(second, {"size": 336}) as p2:
        out, kept = p1.get_and_update_item((image_item(1), updates), "h1")  # processed
        assert kept is updates
        assert p2.is_cached(["h1", "nope"]) == [True, False]  # no updates there before
        assert second.accel.skipped["processor"] == 1
        hit, rebuilt = p2.get_and_update_item(None, "h1")  # vLLM's hit: no data
        assert all(behaves_alike(a, b) for a, b in zip(updates, rebuilt, strict=True))
        assert handout_from_item(hit).handle == handout_from_item(out).handle
        assert first.store.stats().puts == 1 and second.items["hit"] == 1
        for n, item in enumerate((out, hit)):
            for receiver in receivers:
                assert same_item(read(receiver, f"r{n}", item, "h1"), image_item(1))
        assert first.store.unread(handout_from_item(out).handle) == (0, 0)


def test_a_record_for_other_kwargs_or_forged_or_missing_is_refused_and_processed(
        node: Any) -> None:
    (first, second), receivers = node
    with processing(first, {"size": 336}) as p1:
        p1.get_and_update_item((image_item(2), families()["llava"]), "h2")
        p1.get_and_update_item((image_item(4), ["not vLLM's"]), "h4")  # no record
        value = item_to_value(image_item(5))
        value[RECORD_FIELD] = msgpack.packb([1, _fingerprint(p1), [
            ["image", 0, "replace", [0, [1 << 31, 1]], [1, 1], None]]])  # a forged id
        first.store.give_back(first.store.put("h5", value))
    with processing(second, {"size": 672}) as p2:  # other kwargs, another fingerprint
        handle = first.store.handle_of("h2")
        assert p2.is_cached(["h2"]) == [False]
        assert second.store.unread(handle) == (1, 1)  # the peek's hand-out went back
    try:
        with processing(second, {"size": 336}) as p2:
            assert p2.is_cached(["h4", "h5", "h2"]) == [False, False, True]
            assert second.accel.refused == {"missing": 1, "version": 0, "fingerprint": 1,
                                            "damaged": 1}
            assert second.accel.skipped["processor"] == 1
            out, _ = p2.get_and_update_item((image_item(4), ["not vLLM's"]), "h4")
            assert second.items["shared"] == 1  # processed here, the store's copy handed out
    finally:
        second.release_sender_touches()


def test_without_a_processing_context_nothing_is_written_or_read(node: Any) -> None:
    """Outside vLLM's cached processing (the hook did not run: the sender called directly)
    no fingerprint is known."""
    (first, second), _ = node
    first.get_and_update_item((image_item(6), families()["llava"]), "h6")
    entry = first.store._index.by_key["h6"]
    body = bytes(first.store._writer_ring.payload(entry.chunk)[:4096])
    assert RECORD_FIELD.encode() not in body
    with processing(second, {}) as p2:
        assert p2.is_cached(["h6"]) == [False] and second.accel.refused["missing"] == 1


def test_records_are_small() -> None:
    sizes = {name: len(_records.write(u, FP) or b"") for name, u in families().items()}
    assert all(0 < size <= 96 for size in sizes.values()), sizes  # 16 of them: fingerprint

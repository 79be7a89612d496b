"""One writer interface: StoreWriter and RemoteWriter both meet WriterAPI, with the same
signatures; one table of operations drives the host and the remote writer."""

from __future__ import annotations

import inspect
import threading

import numpy as np
import pytest

from shmstore.store import _wire
from shmstore.store._api import WriterAPI
from shmstore.store._host import WriterHost
from shmstore.store._remote import RemoteWriter
from shmstore.store._writer import StoreWriter
from tests._names import InvalidKey, ObjectStore, StaleHandle

MEMBERS = [n for n in dir(WriterAPI) if not n.startswith("_") or n == "__len__"]
METHODS = [n for n in MEMBERS if inspect.isfunction(getattr(WriterAPI, n))]


@pytest.mark.parametrize("cls", [StoreWriter, RemoteWriter], ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", METHODS)
def test_both_writers_have_each_call_with_the_interfaces_signature(cls: type, method: str) -> None:
    """Same parameter names, kinds and defaults; an implementation may add keyword-only
    parameters with defaults (RemoteWriter's wait=False)."""
    want = inspect.signature(getattr(WriterAPI, method)).parameters
    have = inspect.signature(getattr(cls, method)).parameters
    shared = [(p.name, p.kind, p.default) for p in list(have.values())[:len(want)]]
    assert shared == [(p.name, p.kind, p.default) for p in want.values()], f"{cls.__name__}.{method}"
    extra = list(have.values())[len(want):]
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra), extra


def test_both_writers_are_writer_apis_and_the_host_handles_every_operation(name: str) -> None:
    with ObjectStore.create(name, capacity_bytes=1 << 20, n_readers=1) as writer:
        host = WriterHost(writer, threading.RLock())
        try:
            assert host._handlers.keys() == _wire.OPS.keys()
            with RemoteWriter(name, connect_timeout_s=5) as remote:
                assert isinstance(writer, WriterAPI) and isinstance(remote, WriterAPI)
        finally:
            host.close()


def test_the_client_refuses_a_call_outside_the_table() -> None:
    assert set(_wire.POSTABLE) == {"give_back", "narrow"}
    with pytest.raises(_wire.InvalidArgument):
        _wire.request("clear", True, post=True)  # not postable
    with pytest.raises(_wire.InvalidArgument):
        _wire.request("unread")  # one argument missing


@pytest.mark.parametrize(("frame", "why"), [
    (["len", 1], "carries 0 arguments"),
    (["clear", 1], "a flag"),
    (["give_back", [1, 2], None], "handle"),
    (["narrow", [64, 1, b"x" * 16, 1], "1", []], "number"),
    (["end_handouts", [[[64, 1, b"x" * 16, 1], ["2"]]]], "number"),
    (["post", "clear", False], "may be posted"),
    (["nope"], "unknown request"),
    ([7], "op, args"),
])
def test_parse_request_refuses_frames_outside_the_table(frame: list, why: str) -> None:
    with pytest.raises(_wire.ProtocolError, match=why):
        _wire.parse_request(frame)


def test_a_request_the_client_builds_is_what_the_host_parses() -> None:
    from shmstore.handle import Handle
    handle = Handle(128, 3, b"d" * 16, 9)
    assert _wire.parse_request(_wire.request("end_handouts", [(handle, (1, 2))])) == (
        "end_handouts", [[(handle, [1, 2])]], False)
    assert _wire.parse_request(_wire.request("narrow", handle, 2, iter([0, 1]), post=True)) == (
        "narrow", [handle, 2, [0, 1]], True)


def test_the_local_writers_batch_hand_out_is_all_or_nothing(name: str) -> None:
    with ObjectStore.create(name, capacity_bytes=1 << 20, n_readers=1) as writer:
        a = writer.put("a", np.zeros(8))
        with pytest.raises(InvalidKey):
            writer.hand_out_cached(["a", ""])
        assert writer.unread(a) == (1,) and writer.stats().hits == 0
        found = writer.hand_out_cached(["missing", "a", "a"])
        assert [f and (f.handle, f.number, f.record) for f in found] == [
            None, (a, 2, None), (a, 3, None)] and writer.handout_seq == 3
        assert found[1].object_id == found[2].object_id == writer.object_id("a")
        assert writer.cached(["a", "b"]) == [True, False] and writer.unread(a) == (3,)
        writer.give_back(a, 3)
        writer.give_back(a, 2)
        writer.clear()
        with pytest.raises(StaleHandle):
            writer.give_back(a)

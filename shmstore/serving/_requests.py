"""Hand-outs that follow an engine's requests (in the API process), told by the engine's adapter
(vLLM's: vllm/_hooks.py, whose hook names are in the table below).

vLLM's workers read a request's multimodal items when the request is first scheduled. A request
that never gets there (refused after rendering, aborted while queued, failed) would leave its
hand-outs owed for ever, and once the ring came round to one of them every later miss would go
inline for the life of the server. The RequestLedger below settles every hand-out with its
request:

    hand-out made (sender)         recorded by its number, not yet tied to a request
    OutputProcessor.add_request    tied to the request id; a hand-out a second request carries
                                   too (n > 1 samples) gets a hand-out of its own for it
    InputProcessor.process_inputs  raised: the request never reaches the engine; its hand-outs
      raised                       are given back at once ("refused")
    engine refused it on arrival   (a paused engine; vLLM 0.33) the same: nothing ran
    request finished or aborted    its hand-outs end; once `settle_s` has passed (the engine
                                   has seen the abort and finished any step that read them)
                                   they are over, and the store is told (end_handouts): an
                                   object whose every hand-out is over, but that a worker
                                   still owes reads on, is withdrawn when the store needs the
                                   space (counted as "aborted" or "finished_unread")
    no request ever claimed it     the same after `lease_s` from the hand-out ("lease")
    DP client picks an engine      the request's hand-outs are narrowed to that engine's
                                   workers (routed): the others never pin them

Several API servers share one store (one writes it, the others through RemoteWriter), each
with its own ledger for its own hand-outs. The store, not a ledger, decides what to withdraw:
only an object whose every hand-out some ledger said is over, so an object another server's
live request holds is never withdrawn. Each ledger says so within PRUNE_EVERY_S (a sweep
thread), so that a server whose put finds the store full is not held up by another server's
idle ledger.

Withdrawing drops the object, not a count: a hand-out read by one worker and not by another
settles as exactly as one that nobody read, and a read that still came would fail loudly
(StaleHandle), never read other bytes. Nothing a live request still needs is withdrawn: an
object with a hand-out of a live request, or one a request is being rendered with (touched), is
left alone.

Threads (vLLM): the sender's cache methods run on vLLM's multimodal thread, the hooks on the
event loop (AsyncLLM) or the caller's thread (LLMEngine). Every method takes `lock`, which the sender
also holds around each of its store calls: the store writer sees one thread at a time.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import Closed, SegmentClosed, ShmStoreError, StaleHandle
from ..handle import Handle
from ..store._api import WriterAPI
from ._log import log

__all__ = ["RequestLedger", "REASONS"]

REASONS = ("refused", "aborted", "finished_unread", "lease")
PRUNE_EVERY_S = 1.0  # how often the sweep thread tells the store which hand-outs are over


@dataclass(slots=True, eq=False)
class _Handout:
    handle: Handle
    key: str
    made_s: float
    live_requests: int = 0  # requests that carry it and have not ended
    ended_s: float | None = None  # when the last of them ended
    aborted: bool = False  # one of them was aborted (else they finished)
    unclaimed: bool = False  # ended with the render that made it, before any request claimed it
    requests: list[str] = field(default_factory=list)


class RequestLedger:
    """Which request each hand-out of one sender belongs to, and settling them when requests
    end. Any thread may call it; see the module docstring."""

    def __init__(self, store: WriterAPI, settle_s: float, lease_s: float,
                 busy: Callable[[Handle], bool], clock: Callable[[], float] = time.monotonic,
                 lock: threading.RLock | None = None) -> None:
        self.lock = threading.RLock() if lock is None else lock
        self._store = store
        self._settle_s = settle_s
        self._lease_s = lease_s
        self._busy = busy  # a hand-out kept for a request being rendered: never withdrawn
        self._clock = clock
        self._handouts: dict[int, _Handout] = {}
        self._requests: dict[str, list[int]] = {}
        self._last_sweep = clock()
        self.settled = dict.fromkeys(REASONS, 0)  # hand-outs settled, by reason
        self._closing = threading.Event()
        threading.Thread(target=self._sweep, args=(weakref.ref(self), self._closing),
                         name="shmstore-ledger", daemon=True).start()

    # -- the sender ----------------------------------------------------------------------------

    def handed_out(self, number: int, handle: Handle, key: str) -> None:
        """Record hand-out `number` of `handle` (made for `key` just now)."""
        with self.lock:
            self._handouts[number] = _Handout(handle, key, self._clock())

    def settle(self, full: bool) -> bool:
        """Tell the store which hand-outs are over (their requests ended `settle_s` ago, or
        nobody claimed them for `lease_s`) and drop their records; without `full`, at most
        once per PRUNE_EVERY_S. Return whether any were (a put that found the store full may
        find room now)."""
        with self.lock:
            now = self._clock()
            if not full and now - self._last_sweep < PRUNE_EVERY_S:
                return False
            self._last_sweep = now
            groups: dict[Handle, list[int]] = {}
            for number, rec in self._handouts.items():
                groups.setdefault(rec.handle, []).append(number)
            over: list[tuple[Handle, list[int]]] = []
            recs_over: list[list[_Handout]] = []
            for handle, numbers in groups.items():
                recs = [self._handouts[n] for n in numbers]
                if any(not self._done(rec, now) for rec in recs) or self._busy(handle):
                    continue
                over.append((handle, numbers))
                recs_over.append(recs)
            if not over:
                return False
            # the records go only once the store took the news (a call that fails keeps them
            # for the next sweep); a remote writer sends them in frames it can carry
            ended = self._store.end_handouts(over)
            for _, numbers in over:
                for number in numbers:
                    self._handouts.pop(number, None)
            for recs, owed in zip(recs_over, ended, strict=True):
                if owed:  # still owed reads: these may be among them, never to be read
                    reason = self._reason(recs)
                    self.settled[reason] += len(recs)
                    log.info("shmstore: %d hand-out(s) of item %s are over unread (%s): the "
                             "store may withdraw it", len(recs), recs[0].key, reason)
            return True

    @staticmethod
    def _sweep(ref: weakref.ref[RequestLedger], closing: threading.Event) -> None:
        """The sweep thread: settle about once per PRUNE_EVERY_S until the ledger is closed
        or gone."""
        while not closing.wait(PRUNE_EVERY_S):
            ledger = ref()
            if ledger is None:
                return
            try:
                ledger.settle(full=False)
            except (Closed, SegmentClosed) as exc:  # the store went away (shutdown)
                log.debug("shmstore: hand-out sweep ends: %s", exc)
                return
            except ShmStoreError as exc:  # kept: tried again at the next sweep
                log.warning("shmstore: settling hand-outs failed, tried again: %s", exc)
            del ledger

    def close(self) -> None:
        """Stop the sweep thread (idempotent)."""
        self._closing.set()

    def _done(self, rec: _Handout, now: float) -> bool:
        if rec.live_requests:
            return False
        if rec.ended_s is not None:
            return now - rec.ended_s >= self._settle_s
        return now - rec.made_s >= self._lease_s

    @staticmethod
    def _reason(recs: list[_Handout]) -> str:
        if any(rec.ended_s is None for rec in recs):
            return "lease"
        if any(rec.unclaimed for rec in recs):
            return "refused"
        return "aborted" if any(rec.aborted for rec in recs) else "finished_unread"

    def forget(self) -> None:
        """Drop the records of objects the store's clear dropped (those it kept for their
        readers still settle as before)."""
        with self.lock:
            self._handouts = {n: r for n, r in self._handouts.items() if self._live(r.handle)}

    def _live(self, handle: Handle) -> bool:
        try:
            self._store.unread(handle)
            return True
        except StaleHandle:
            return False

    # -- hooks in vLLM's API process -----------------------------------------------------------

    def request_added(self, request_id: str, numbers: Iterable[int]) -> list[tuple[int, int]]:
        """Tie hand-outs to `request_id`. A hand-out that another request carries already gets
        a hand-out of its own for this one: return (old number, new number) pairs for those."""
        renumbered: list[tuple[int, int]] = []
        with self.lock:
            mine = self._requests.setdefault(request_id, [])
            for number in numbers:
                rec = self._handouts.get(number)
                if rec is None:
                    continue  # not this sender's, or settled already
                if rec.unclaimed:  # its render ended first: claimed after all
                    rec.unclaimed, rec.ended_s = False, None
                if rec.live_requests or rec.ended_s is not None:
                    try:
                        new = self._store.hand_out(rec.handle).number
                    except StaleHandle:
                        log.warning("shmstore: item %s of request %s is gone; its workers will "
                                    "ask for it again", rec.key, request_id)
                        continue
                    rec = self._handouts[new] = _Handout(rec.handle, rec.key, self._clock())
                    renumbered.append((number, new))
                    number = new
                rec.live_requests += 1
                rec.requests.append(request_id)
                mine.append(number)
        return renumbered

    def request_ended(self, request_id: str, aborted: bool) -> None:
        """`request_id` finished or was aborted: its hand-outs end (settled later)."""
        with self.lock:
            numbers = self._requests.pop(request_id, None)
            if not numbers:
                return
            now = self._clock()
            for number in numbers:
                rec = self._handouts.get(number)
                if rec is None:
                    continue
                rec.live_requests -= 1
                rec.aborted |= aborted
                if not rec.live_requests:
                    rec.ended_s = now

    def render_ended(self, numbers: Iterable[int]) -> None:
        """The server task that rendered these hand-outs has ended: those no request claimed
        will never be sent (the server refused the request after rendering, or its client
        left first). They end now and are settled like aborted ones, after `settle_s`; a
        claim that still comes takes them back."""
        with self.lock:
            now = self._clock()
            for number in numbers:
                rec = self._handouts.get(number)
                if rec is not None and not rec.live_requests and rec.ended_s is None:
                    rec.ended_s, rec.unclaimed = now, True

    def refused(self, numbers: Iterable[int]) -> None:
        """A request carrying these hand-outs never reached the engine: give them back now."""
        with self.lock:
            for number in numbers:
                rec = self._handouts.get(number)
                if rec is None or rec.live_requests or rec.ended_s is not None:
                    continue  # claimed by a request that did reach the engine
                self._give_back(number, rec)

    def request_refused(self, request_id: str) -> None:
        """The engine refused `request_id` on arrival (a paused engine): it ran nothing, so no
        worker reads its hand-outs; they are given back now, as `refused`."""
        with self.lock:
            for number in self._requests.pop(request_id, ()):
                rec = self._handouts.get(number)
                if rec is not None:
                    rec.live_requests -= 1  # each request holds hand-outs of its own
                    if not rec.live_requests:
                        self._give_back(number, rec)

    def _give_back(self, number: int, rec: _Handout) -> None:
        del self._handouts[number]
        try:
            self._store.give_back(rec.handle, number)
        except StaleHandle:
            return  # withdrawn or cleared meanwhile
        self.settled["refused"] += 1

    def routed(self, request_id: str, readers: Sequence[int]) -> None:
        """`request_id` goes to the engine whose workers are `readers`: its hand-outs are owed
        by them alone (the other engines' workers never see it)."""
        store = self._store
        with self.lock:
            for number in self._requests.get(request_id, ()):
                rec = self._handouts.get(number)
                if rec is None:
                    continue
                # posted: no round trip on the routing path; a handle withdrawn or cleared
                # meanwhile is no error (its workers ask again)
                store.narrow(rec.handle, number, readers, wait=False)

    @property
    def live_requests(self) -> int:
        return len(self._requests)


def numbers_in(obj: Any, number_of: Callable[[Any], int | None], depth: int = 4) -> list[int]:
    """The hand-out numbers of the handle items anywhere in a rendered prompt or request
    (dicts, lists, vLLM's item containers; `depth` levels down)."""
    found: list[int] = []
    number = number_of(obj)
    if number is not None:
        return [number]
    if depth == 0 or isinstance(obj, (str, bytes)):
        return found
    if isinstance(obj, Mapping):
        for value in obj.values():
            found += numbers_in(value, number_of, depth - 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            found += numbers_in(value, number_of, depth - 1)
    return found


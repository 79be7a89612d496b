"""Hand-outs follow requests: the hooks the plugin puts into vLLM's API process and workers."""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any

from ..serving._requests import RequestLedger, numbers_in
from . import _scope
from ._accel import pending, realize
from ._env import LEASE_ENV, LOG_NAME
from ._items import handout_number
from ._receiver import ShmstoreReceiverCache
from ._sender import SENDERS, Processing, ShmstoreSenderCache
from ._vllm import (
    feature_data,
    install_hooks,
    new_requests,
    processor_inputs,
    receiver_cache,
    refused_on_arrival,
    renderer_cache,
    request_id_of,
    resolve_new_request,
)

__all__ = ["install_request_hooks", "wrappers"]

log = logging.getLogger(LOG_NAME)


def _ledgers() -> list[RequestLedger]:
    """The request ledgers of this process's senders (a snapshot: hooks run on other threads)."""
    return [sender.ledger for sender in list(SENDERS)]


def _render_ended(numbers: list[int]) -> None:
    for ledger in _ledgers():
        ledger.render_ended(numbers)


def _feature_numbers(request: Any) -> list[int]:
    return [n for data in feature_data(request) if (n := handout_number(data)) is not None]


def _tell(what: str, call: Callable[[], object]) -> None:
    """Tell the ledgers what vLLM just did. vLLM has acted already (the request is added,
    ended or routed): an error here (API server 0, which writes the store, is gone) is logged
    and never raised into vLLM, where it would strand the request; the lease settles what
    the ledger missed."""
    try:
        call()
    except Exception as exc:
        log.warning("shmstore: could not record that %s (%s); the lease settles its "
                    "hand-outs", what, exc)


def install_request_hooks() -> None:
    """Wrap the vLLM methods where a request is added, refused, finished or aborted (API
    process) and where a worker resolves a new request's items; a method this vLLM lacks is
    named in a warning, and the lease settles what it would have."""
    install_hooks(wrappers(),
                  f"hand-outs it would settle are settled by the lease ({LEASE_ENV})")


# -- the hooks, one per place of _vllm.HOOK_POINTS: original method in, wrapped one out --

def add_request(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, request, *args, **kwargs)
        numbers = _feature_numbers(request)
        if numbers:
            for ledger in _ledgers():
                rid = request_id_of(request)
                _tell(f"request {rid} was added",
                      functools.partial(ledger.request_added, rid, numbers))
        return result
    return wrapper


def finish_request(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: Any, req_state: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, req_state, *args, **kwargs)
        rid = request_id_of(req_state)
        for ledger in _ledgers():
            _tell(f"request {rid} finished",
                  functools.partial(ledger.request_ended, rid, aborted=False))
        return result
    return wrapper


def process_outputs(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        # before vLLM ends them through _finish_request, which would count them as finished
        outputs = args[0] if args else kwargs.get("engine_core_outputs")
        for rid in refused_on_arrival(outputs):
            for ledger in _ledgers():
                _tell(f"request {rid} was refused on arrival",
                      functools.partial(ledger.request_refused, rid))
        return original(self, *args, **kwargs)
    return wrapper


def abort_requests(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        aborted = original(self, *args, **kwargs)
        for ledger in _ledgers():
            for request_id in aborted or ():
                _tell(f"request {request_id} was aborted",
                      functools.partial(ledger.request_ended, request_id, aborted=True))
        return aborted
    return wrapper


def process_inputs(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: Any, request_id: Any, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, request_id, prompt, *args, **kwargs)
        except BaseException:
            ledgers = _ledgers()
            numbers = numbers_in(prompt, handout_number) if ledgers else []
            for ledger in ledgers:
                _tell(f"request {request_id} was refused",
                      functools.partial(ledger.refused, numbers))
            raise
    return wrapper


def apply_mm_cache(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: Any, scheduler_output: Any) -> Any:
        cache = receiver_cache(self)
        if not isinstance(cache, ShmstoreReceiverCache):
            return original(self, scheduler_output)
        for req_data in new_requests(scheduler_output):
            resolve_new_request(req_data, cache.features_of_request)
        return None
    return wrapper


def render_async(original: Any) -> Any:
    @functools.wraps(original)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        # held as long as the server's task for this request (its context): what it lists
        # and no request claimed by then was never sent
        held = _scope.rendering()
        rendered = held.numbers
        weakref.finalize(held, _render_ended, rendered)
        try:
            return await original(*args, **kwargs)
        except BaseException:  # refused while rendering: never sent
            for ledger in _ledgers():
                _tell("a request was refused while rendering",
                      functools.partial(ledger.refused, list(rendered)))
            rendered.clear()
            raise
    return wrapper


def process_tokens_async(original: Any) -> Any:
    @functools.wraps(original)
    async def wrapper(self: Any, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        sender = renderer_cache(self)
        if isinstance(sender, ShmstoreSenderCache) and not kwargs.get("skip_mm_cache"):
            try:
                await sender.before_processing(self, prompt)
            except Exception as exc:  # the pool is an acceleration: vLLM's path goes on
                log.warning("shmstore: the miss pool step failed (%s); vLLM processes the "
                            "request's items itself", exc)
        engine_input = await original(self, prompt, *args, **kwargs)
        held = _scope.rendered()
        if held is not None and SENDERS:
            held.numbers.extend(numbers_in(engine_input, handout_number))
        return engine_input
    return wrapper


def engine_for_request(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        engine = original(self, request, *args, **kwargs)
        rid = request_id_of(request)
        for sender in list(SENDERS):
            _tell(f"request {rid} went to engine {engine!r}",
                  functools.partial(sender.routed, rid, int.from_bytes(engine, "little")))
        return engine
    return wrapper


def cached_apply(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        cache, mm_kwargs, items = processor_inputs(inputs)
        if not isinstance(cache, ShmstoreSenderCache):
            return original(self, inputs, *args, **kwargs)
        with cache.processing(inputs, mm_kwargs, items) as scoped:
            return original(self, scoped, *args, **kwargs)
    return wrapper


def missing_items(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        # the sender's is_cached decodes the misses' lazy images (vLLM's decode, its own
        # errors) before this step reads them for the processor; a cache that is not the
        # sender's view of one request's processing cannot: every lazy image is decoded
        call = signature.bind(self, *args, **kwargs).arguments
        items, view = call.get("mm_data_items"), call.get("cache")
        if not isinstance(view, Processing):
            realize(items)
            return original(self, *args, **kwargs)
        view.scope.pending = pending(items, call.get("mm_hashes"))
        try:
            return original(self, *args, **kwargs)
        finally:
            view.scope.pending = {}
    return wrapper


def uncached_apply(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        realize(processor_inputs(inputs)[2])
        return original(self, inputs, *args, **kwargs)
    return wrapper


HOOKS: dict[str, Callable[[Any], Any]] = {
    "add_request": add_request, "engine_for_request": engine_for_request,
    "render_async": render_async, "process_tokens_async": process_tokens_async,
    "finish_request": finish_request, "abort_requests": abort_requests,
    "process_outputs": process_outputs,
    "process_inputs": process_inputs, "apply_mm_cache": apply_mm_cache,
    "cached_apply": cached_apply, "missing_items": missing_items,
    "uncached_apply": uncached_apply,
}


def wrappers() -> dict[str, Callable[[Any], Any]]:
    """The hook for each place of _vllm.HOOK_POINTS: original method in, wrapped one out."""
    return dict(HOOKS)

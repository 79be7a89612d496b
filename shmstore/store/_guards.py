"""The writer's guards, one mechanism for its exception safety: `one_thread` for a short call
that must not overlap another thread's, `hands_out` for a call that hands out (it holds the
writer, and takes back every hand-out it made if an exception surfaces before it returns).
StoreWriter (store/_writer.py) applies them to every public method that needs one; `self` is
that writer (typed Any here: this module is imported by it)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from ._index import Entry

__all__ = ["one_thread", "hands_out", "Done"]

_Method = TypeVar("_Method", bound=Callable[..., Any])
_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")
Done = list[tuple[Entry, int]]  # the hand-outs a call made so far: taken back if it fails


def one_thread(method: _Method) -> _Method:
    """A short writer call that refuses to start while another thread is inside the writer
    (WrongThread); it does not hold the writer, so that its last statement stays its commit
    point (an exception injected after it must not report undone what was done)."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._check_thread()
        return method(self, *args, **kwargs)
    return cast(_Method, call)

def hands_out(method: Callable[Concatenate[Any, Done, _Params], _Result]
              ) -> Callable[Concatenate[Any, _Params], _Result]:
    """A writer call that hands out: it holds the writer (one thread at a time, close waits
    for it) and gets a fresh `done` list that HandOuts.make fills; if an exception surfaces
    anywhere before the call has returned (in it, in the guard's bookkeeping, from a signal
    handler), every hand-out in `done` is taken back, so a HandOut the caller never got owes
    no reader anything. The one mechanism of the writer's exception safety for hand-outs."""
    def call(self: Any, /, *args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        done: Done = []
        try:
            self._guard_enter()
            try:
                return method(self, done, *args, **kwargs)
            finally:
                self._guard_leave()
        except BaseException:
            self._handouts.undo(done)
            raise
    functools.update_wrapper(call, method)
    del call.__wrapped__  # type: ignore[attr-defined]
    signature = inspect.signature(method)
    params = list(signature.parameters.values())
    call.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[params[0], *params[2:]])  # without `done`: what callers pass
    return call

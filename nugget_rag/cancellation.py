"""Cooperative cancellation: work that its caller may abandon (a server request whose client left, or whose deadline
passed) runs inside `cancellable(stop)`, and the library's loops call `check()` between their steps (each batch the
encoder compresses, each probe pass, each decoding step, each batch an index ingests), which raises RequestCancelled
once `stop()` is true. Work stops at its next step; what a finished step stored stays, whole.

The stop lives in a context variable, so it follows the work through its calls (and LangChain's runnables, which
copy the context) without a parameter on any public API: outside `cancellable`, `check()` does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

Stop = Callable[[], bool]
_STOP: ContextVar[Stop | None] = ContextVar("nugget_rag_stop", default=None)


class RequestCancelled(Exception):
    """The work stopped before it ended: its request was cancelled (its client left, or its deadline passed)."""


@contextmanager
def cancellable(stop: Stop) -> Iterator[None]:
    """Within the block, `check()` raises RequestCancelled once `stop()` (or an enclosing block's stop) is true."""
    outer = _STOP.get()
    token = _STOP.set(stop if outer is None else lambda: outer() or stop())
    try:
        yield
    finally:
        _STOP.reset(token)


def current_stop() -> Stop | None:
    """The stop of the enclosing `cancellable` block, or None outside one."""
    return _STOP.get()


def check() -> None:
    """Raise RequestCancelled if the enclosing `cancellable` block's work must stop; nothing outside one."""
    stop = _STOP.get()
    if stop is not None and stop():
        raise RequestCancelled("the request was cancelled before its work ended")

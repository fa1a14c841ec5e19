"""Admission: at most `max_pending` requests in flight, each with a deadline and a stop that its work checks between
steps (cancellation.py); a client that disconnects stops its request's work at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import anyio
from fastapi import HTTPException, Request

from ..cancellation import RequestCancelled
from .middleware import Metrics

T = TypeVar("T")


class Slots:
    """Requests in flight, at most `limit`; each slot also holds its request's deadline."""

    def __init__(self, limit: int, timeout_s: float, metrics: Metrics):
        self.limit, self.timeout_s, self.metrics = limit, timeout_s, metrics
        self.count = 0
        self.lock = threading.Lock()

    def admit(self) -> Slot:
        with self.lock:
            if self.count >= self.limit:
                raise HTTPException(503, f"the server is busy ({self.limit} requests in flight); retry shortly")
            self.count += 1
        return Slot(self)


class Slot:
    """One admitted request, freed once: when it ends, fails or is cancelled."""

    def __init__(self, slots: Slots):
        self._slots = slots
        self.admitted = time.monotonic()
        self.deadline = self.admitted + slots.timeout_s
        self._gone = threading.Event()
        self._freed = False

    def stop(self) -> bool:
        """Whether its request's work must stop: its client left, or it ran past its deadline."""
        return self._gone.is_set() or time.monotonic() > self.deadline

    def run(self, work: Callable[[], T]) -> T:
        """`work()`, the slot freed when it ends (work that checks `stop` raises RequestCancelled once it stops)."""
        try:
            return work()
        except RequestCancelled:
            self.free("deadline")  # (a client that left has freed it already)
            raise
        finally:
            self.free()

    def free(self, cancelled: str | None = None) -> None:
        """Free the slot (once); `cancelled`: why its answer was cut off, for the metrics."""
        with self._slots.lock:
            if self._freed:
                return
            self._freed = True
            self._slots.count -= 1
        if cancelled:
            self._slots.metrics.cancelled.labels(cancelled).inc()

    def disconnect(self) -> None:
        """Its client left: its work stops at its next step (an answer leaves its batch at the next token), and the
        slot is free now."""
        self._gone.set()
        self.free("disconnect")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def watched(http: Request, slot: Slot, work: Callable[[], T]) -> T:
    """`work()`, run in a thread; a client that disconnects meanwhile stops the slot (its work stops at its next step)
    and raises ClientGone at once."""
    outcome = {}
    async with anyio.create_task_group() as group:
        async def run():
            try:
                outcome["value"] = await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
            except Exception as err:
                outcome["error"] = err
            group.cancel_scope.cancel()

        group.start_soon(run)
        while not await http.is_disconnected():
            await anyio.sleep(0.1)
        slot.disconnect()
        group.cancel_scope.cancel()
    if "error" in outcome:
        raise outcome["error"]
    if "value" not in outcome:
        raise ClientGone()
    return outcome["value"]


__all__ = ["ClientGone", "Slot", "Slots", "watched"]

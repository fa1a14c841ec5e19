"""Batched decoding of concurrent requests (`nugget-rag serve`): requests with the same generation settings are
decoded as one batch, one forward pass per step for all of them. A batch takes the requests that arrive within
`wait_s`, and, while the previous batch of those settings still decodes, every request that arrives until it ends.
Decoding a small model is bound by reading its weights, so a batch of 8 costs little more per step than one.
A row whose request is cancelled (its consumer stopped reading, or the stop of `for_request`, or of the `cancellable`
block it was submitted in, says so: cancellation.py) leaves its batch at the next step: the batch's later forward
passes no longer include it, as they no longer include a finished row. A batch whose rows have all left stops. The
batch's own thread starts with no `cancellable` block: one request's stop never stops the others'."""

from __future__ import annotations

import contextvars
import copy
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ..cancellation import RequestCancelled, current_stop
from ..config import DECODER
from ..model.nugget_model import NuggetModel
from ..state.nugget_state import NuggetState
from .decoding import GenerationSettings, RowSteps, generation_steps

_END = object()


@dataclass(eq=False)
class _Row:
    states: Sequence[NuggetState]
    prompt: Sequence[int]
    prefix: Sequence[int] | None
    stop: Callable[[], bool] | None = None
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False  # its consumer stopped reading

    @property
    def left(self) -> bool:
        return self.cancelled or (self.stop is not None and self.stop())

    def leave(self) -> None:
        self.out.put(RequestCancelled("the request was cancelled before its answer ended"))


@dataclass(eq=False)
class _Batch:
    settings: GenerationSettings
    adapter: str | None
    rows: list[_Row] = field(default_factory=list)


class BatchedGenerator:
    """Decodes rows submitted from many threads in shared batches of at most `max_batch` rows.

    `stream` returns one row's steps as `stream_generate` gives them for a single row: its new text per step, the
    last step included, then its `finish_reason`. A row whose consumer stops (a client gone) leaves its batch; the
    others go on.
    """

    _stop: Callable[[], bool] | None = None

    def __init__(self, model: NuggetModel, max_batch: int = 8, wait_s: float = 0.01):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.max_batch, self.wait_s = model, max_batch, wait_s
        self._open: dict[tuple, _Batch] = {}  # batches still taking rows, by what they must share
        self._turns: dict[tuple, threading.Lock] = {}  # held by the batch of those settings that decodes now
        self._lock = threading.Lock()
        self.batch_sizes: list[int] = []  # of every batch run (for reports and tests)

    def for_request(self, stop: Callable[[], bool]) -> BatchedGenerator:
        """This generator (its batches shared) for one request: its rows leave their batch at the first step where
        `stop()` is true, and their streams raise RequestCancelled."""
        view = copy.copy(self)
        view._stop = stop
        return view

    def stream(self, states: Sequence[NuggetState], prompt: Sequence[int], settings: GenerationSettings,
               prefix: Sequence[int] | None = None, adapter: str | None = DECODER) -> RowSteps:
        row = _Row(list(states), list(prompt), prefix, self._stop or current_stop())
        # a seeded sample is reproducible only alone: its random stream would be shared by the batch
        key = (adapter, settings.model_dump_json()) if settings.seed is None else (id(row),)
        with self._lock:
            batch = self._open.get(key)
            if batch is None:
                batch = self._open[key] = _Batch(settings, adapter)
                turn = self._turns.setdefault(key, threading.Lock()) if settings.seed is None else threading.Lock()
                # in a context of its own: a generation step's cancellation check sees no request's stop
                threading.Thread(target=contextvars.Context().run, args=(self._run, key, batch, turn),
                                 daemon=True).start()
            batch.rows.append(row)
            if len(batch.rows) >= self.max_batch:
                del self._open[key]
        return RowSteps(self._pieces(row))

    @staticmethod
    def _pieces(row: _Row) -> Iterator[tuple[str, str | None]]:
        """The row's (text, finish reason or None) steps."""
        try:
            while (item := row.out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            row.cancelled = True

    def _run(self, key: tuple, batch: _Batch, turn: threading.Lock) -> None:
        with turn:  # the batch gathers rows until the previous one is done, then for wait_s
            time.sleep(self.wait_s)
            with self._lock:
                if self._open.get(key) is batch:
                    del self._open[key]
            self._decode_batch(batch)

    def _decode_batch(self, batch: _Batch) -> None:
        rows = []
        for row in batch.rows:
            if row.left:  # cancelled while it waited for its batch's turn
                row.leave()
            else:
                rows.append(row)
        if not rows:
            return
        self.batch_sizes.append(len(rows))
        try:
            self._decode(rows, batch)
        except Exception as err:
            if len(rows) == 1:
                rows[0].out.put(err)
                return
            for row in rows:  # one row's bad input (a prompt too long) must not fail the others: each alone
                try:
                    self._decode([row], batch)
                except Exception as alone:
                    row.out.put(alone)

    def _decode(self, rows: list[_Row], batch: _Batch) -> None:
        """Decode the rows together; raises only where no row has had a step yet (bad input), else hands the error
        to every row still running."""
        live, gone, started = set(range(len(rows))), set(), False
        steps = generation_steps(self.model, [r.states for r in rows], [r.prompt for r in rows], batch.settings,
                                 adapter=batch.adapter, prefixes=[r.prefix for r in rows], leave=gone)
        try:
            for pieces, done in steps:
                started = True
                for i in sorted(live):
                    rows[i].out.put((pieces[i], done[i]))
                    if done[i]:
                        rows[i].out.put(_END)
                        live.discard(i)
                for i in [i for i in live if rows[i].left]:  # the next step decodes it no more
                    rows[i].leave()
                    live.discard(i)
                    gone.add(i)
                if not live:
                    break
        except Exception as err:
            steps.close()
            if not started:
                raise
            for i in live:
                rows[i].out.put(err)
            return
        steps.close()
        for i in live:
            rows[i].out.put(_END)

"""A run stopped from outside keeps its work: SIGTERM (a scheduler, `kill`, a session's end) or Ctrl-C asks the
training loop to stop after the update it is in, with a checkpoint, as `max_time` does; a second signal stops at
once."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """While entered (in the main thread: elsewhere signals cannot be caught), `requested` names the first stop
    signal received, else None."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:  # the second: what the signal did before this run
            signal.signal(signum, self._previous.pop(signum))
            signal.raise_signal(signum)
            return
        self.requested = name
        log.warning("%s: stopping after this update, with a checkpoint (send it again to stop at once)", name)

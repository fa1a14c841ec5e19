"""Key/value states of prompt prefixes (the chat template's opening, a system prompt), kept between queries."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from .state import NuggetState

Prefix = tuple[int, ...]


class PrefixCache:
    """The last `size` prefixes' states, keyed by their ids and a stamp of the weights that computed them."""

    def __init__(self, size: int):
        self.size = size
        self._states: OrderedDict[tuple[Prefix, tuple], NuggetState] = OrderedDict()
        self._lock = threading.Lock()

    def states(self, prefixes: Sequence[Sequence[int]], stamp: tuple | None,
               compute: Callable[[list[Prefix]], dict[Prefix, NuggetState]]) -> list[NuggetState | None]:
        """Each prefix's states (None for an empty one), those not kept computed at once by `compute`; equal prefixes
        run once. With a `stamp` they are kept and reused under the same stamp; with None (under autograd) never."""
        unique = list(dict.fromkeys(tuple(p) for p in prefixes if len(p)))
        if not unique:
            return [None] * len(prefixes)
        with self._lock:
            found = {u: self._states[(u, stamp)] for u in unique if stamp and (u, stamp) in self._states}
        missing = [u for u in unique if u not in found]
        if missing:
            found.update(compute(missing))
        if stamp:
            with self._lock:
                for u in unique:
                    self._states[(u, stamp)] = found[u]
                    self._states.move_to_end((u, stamp))
                while len(self._states) > self.size:
                    self._states.popitem(last=False)
        return [found[tuple(p)] if len(p) else None for p in prefixes]

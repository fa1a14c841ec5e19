"""Key/value states of prompt prefixes (the chat template's opening, a system prompt), kept between queries."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from ..config import DECODER
from ..state.nugget_state import NuggetState
from .attention import CaptureNuggets

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


class PromptPrefixes:
    """NuggetModel's prompt-prefix states, as a mixin: NuggetModel sets the attributes below."""

    prefix_cache: PrefixCache
    tokenizer: object
    device: torch.device
    pad: Callable[[Sequence[Sequence[int]]], tuple[torch.Tensor, torch.Tensor]]
    run: Callable[..., torch.Tensor]
    weights_stamp: Callable[[str | None], tuple]
    state_tag: Callable[[str], str]

    def prefix_states(self, prefixes: Sequence[Sequence[int]],
                      adapter: str | None = DECODER) -> list[NuggetState | None]:
        """Each prompt prefix's key/value states in every layer (positions 0..h-1; None for an empty one): under
        autograd with the adapter's gradient, else kept (PrefixCache) until the adapter's weights change (or the
        autocast dtype they are computed in)."""
        kind = self.device.type
        autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        stamp = (*self.weights_stamp(adapter), autocast) if not torch.is_grad_enabled() else None
        return self.prefix_cache.states(prefixes, stamp, lambda unique: self.run_prefixes(unique, adapter))

    def run_prefixes(self, unique: list[Prefix], adapter: str | None) -> dict[Prefix, NuggetState]:
        """The states of distinct prompt prefixes, computed in one batch."""
        input_ids, _ = self.pad(unique)
        lengths = [len(u) for u in unique]
        steps = torch.arange(max(lengths), device=self.device)
        capture = CaptureNuggets(torch.stack([steps.clamp(max=n - 1) for n in lengths]))
        self.run(adapter, capture, input_ids=input_ids)
        keys, values = capture.stacked()
        return {u: NuggetState(keys[:, b, :, :n], values[:, b, :, :n], steps[:n], torch.zeros(n, device=self.device),
                               self.tokenizer.convert_ids_to_tokens(list(u)), n, self.state_tag("prompt-prefix"))
                for b, (u, n) in enumerate(zip(unique, lengths))}

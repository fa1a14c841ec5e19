"""Key/value states of prompt prefixes (the chat template's opening, a system prompt), kept between queries."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .attention import CaptureNuggets
from .state import NuggetState

if TYPE_CHECKING:
    from .model import NuggetModel


class PrefixCache:
    """The last `size` prefixes' states computed without gradients, keyed by ids, adapter and its weights' versions."""

    def __init__(self, size: int):
        self.size = size
        self._states: OrderedDict[tuple, NuggetState] = OrderedDict()
        self._lock = threading.Lock()

    def states(self, model: NuggetModel, prefixes: Sequence[Sequence[int]], adapter: str | None) -> list[NuggetState | None]:
        """Each prefix's states at positions 0..h-1 (None for an empty one); equal prefixes run once. Under autograd
        they carry the adapter's gradient and are not kept; without it they are reused until its weights change."""
        unique = list(dict.fromkeys(tuple(p) for p in prefixes if len(p)))
        if not unique:
            return [None] * len(prefixes)
        stamp = model.weights_stamp(adapter) if not torch.is_grad_enabled() else None
        with self._lock:
            found = {u: self._states[(u, stamp)] for u in unique if stamp and (u, stamp) in self._states}
        missing = [u for u in unique if u not in found]
        if missing:
            found.update(self._run(model, missing, adapter))
        if stamp:
            with self._lock:
                for u in unique:
                    self._states[(u, stamp)] = found[u]
                    self._states.move_to_end((u, stamp))
                while len(self._states) > self.size:
                    self._states.popitem(last=False)
        return [found[tuple(p)] if len(p) else None for p in prefixes]

    @staticmethod
    def _run(model: NuggetModel, unique: list[tuple[int, ...]], adapter: str | None) -> dict[tuple[int, ...], NuggetState]:
        input_ids, _ = model._pad(unique)
        lengths = [len(u) for u in unique]
        steps = torch.arange(max(lengths), device=model.device)
        capture = CaptureNuggets(torch.stack([steps.clamp(max=n - 1) for n in lengths]))
        model.run(adapter, capture, input_ids=input_ids)
        keys, values = capture.stacked()
        return {
            u: NuggetState(keys[:, b, :, :n], values[:, b, :, :n], steps[:n], torch.zeros(n, device=model.device),
                           model.tokenizer.convert_ids_to_tokens(list(u)), n, model.state_tag("prompt-prefix"))
            for b, (u, n) in enumerate(zip(unique, lengths))
        }

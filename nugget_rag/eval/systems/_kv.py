"""States for the training-free key/value baselines, from the frozen model's pass (model/frozen_pass.py): a
document's keys and values at chosen positions, or at its k best-scored ones, as NuggetStates that the same decoder
reads with adapter=None."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...model.frozen_pass import FrozenPass
from ...model.nugget_model import NuggetModel
from ...state.nugget_state import NuggetState
from .base import budget


def state_at(model: NuggetModel, run: FrozenPass, positions: torch.Tensor, token_ids: Sequence[int], n: int,
             tag: str, scores: torch.Tensor | None = None) -> NuggetState:
    """A NuggetState holding the frozen pass's keys/values at `positions` (ascending)."""
    positions = positions.sort().values.to(run.keys.device)
    tokens = model.tokenizer.convert_ids_to_tokens([int(token_ids[i]) for i in positions.tolist()])
    return NuggetState(
        keys=run.keys[:, :, positions], values=run.values[:, :, positions], positions=positions,
        scores=torch.zeros(len(positions), device=run.keys.device) if scores is None else scores,
        tokens=tokens, n=n, fingerprint=model.state_tag(tag),
    )


def top_states(model: NuggetModel, documents: Sequence[Sequence[int]], runs: Sequence[FrozenPass],
               scores: Sequence[torch.Tensor], ratio: float, method: str) -> list[NuggetState]:
    """Each document's state at its k = ceil(n / r) best-scored positions, tagged `method-rR`."""
    return [state_at(model, run, s.topk(budget(len(ids), ratio)).indices, ids, len(ids), f"{method}-r{ratio}")
            for ids, run, s in zip(documents, runs, scores, strict=True)]

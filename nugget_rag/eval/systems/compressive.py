"""Compressive (paper Sec. 5, after Rae et al.): mean-pooled key/values over chunks of r tokens, training-free.

The document is run through the frozen model; its tokens are cut into k = ceil(n / r) contiguous chunks of about
r tokens; each chunk becomes one key/value slot per layer. Values are averaged as they are. Keys are averaged
before their rotary phase (each key is rotated back to position 0, averaged, then rotated to the chunk's last
position), so the pooled key sits at the chunk's last position, where the nugget scheme renumbers it from.
The paper trains a LoRA decoder for Compressive; this one reads the pooled states with the frozen model.
"""

from __future__ import annotations

import torch

from ...model.attention import rotate_keys
from ...model.frozen_pass import frozen_pass
from ...state.nugget_state import NuggetState
from .base import Env, Reading, Reimplementation, budget, document_readings, register


def chunk_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """k contiguous, non-empty chunks covering 0..n-1 (sizes differ by at most one)."""
    edges = [round(j * n / k) for j in range(k + 1)]
    return [(edges[j], edges[j + 1]) for j in range(k)]


@register("compressive")
class Compressive(Reimplementation):
    label = "Compressive (mean-pooled KV, training-free re-impl.)"

    def prepare(self, env: Env, queries, ratio):
        model = env.model
        inv_freq = model.inv_freq

        def pool(chunk):
            out = []
            for ids, run in zip(chunk, frozen_pass(model, chunk)):
                n = len(ids)
                k = budget(n, ratio)
                at_zero = rotate_keys(run.keys, -torch.arange(n, device=run.keys.device), inv_freq)
                bounds = chunk_bounds(n, k)
                keys = torch.stack([at_zero[:, :, a:b].mean(2) for a, b in bounds], dim=2)
                values = torch.stack([run.values[:, :, a:b].mean(2) for a, b in bounds], dim=2)
                positions = torch.tensor([b - 1 for _, b in bounds], device=keys.device)
                keys = rotate_keys(keys, positions, inv_freq)
                tokens = model.tokenizer.convert_ids_to_tokens([ids[p] for p in positions.tolist()])
                out.append(NuggetState(keys, values, positions, torch.zeros(k, device=keys.device), tokens, n,
                                       model.state_tag(f"compressive-r{ratio}")))
            return out

        return document_readings(env, queries, f"{self.name}@{ratio}", pool, lambda q, states: Reading(states=states))

"""Training-free importance of a document's positions, from the frozen model's pass (frozen_pass.py): observed
attention (H2O; kvpress's ObservedAttentionPress) and KVzip's reconstruction attention. The harness's baselines keep
the best-scored positions; the Scorer warm start fits the Scorer to these scores."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .frozen_pass import FrozenPass, attention_probs, frozen_pass
from .nugget_model import NuggetModel


def observed_scores(model: NuggetModel, run: FrozenPass) -> torch.Tensor:
    """[n] scores of the document's positions (kvpress's ObservedAttentionPress, H2O-style): the attention that
    tokens i >= j pay position j, summed over queries and divided by their number (n - j), averaged over heads and
    summed over layers."""
    n = run.keys.shape[2]
    rows = torch.arange(n, device=run.keys.device)
    total = torch.zeros(n, device=run.keys.device)
    for layer in range(run.keys.shape[0]):
        probs = attention_probs(model, run, rows, layer)  # [heads, n, n]
        total += probs.mean(0).sum(0)
    return total / torch.arange(n, 0, -1, device=total.device)


REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


def repeat_prompt_ids(model: NuggetModel) -> list[int]:
    return model.tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False)


def reconstruction_scores(model: NuggetModel, run: FrozenPass, n: int) -> torch.Tensor:
    """[n] scores of the document's positions (KVzip's) from a frozen pass over document + repeat prompt + document:
    the largest attention any repeated token pays a position, averaged over key/value heads and layers."""
    rows = torch.arange(run.keys.shape[2] - n, run.keys.shape[2], device=run.keys.device)
    kv_heads = run.keys.shape[1]
    total = torch.zeros(n, device=run.keys.device)
    for layer in range(run.keys.shape[0]):
        probs = attention_probs(model, run, rows, layer)[:, :, :n]  # [heads, n repeated, n]
        total += probs.view(kv_heads, -1, n).amax(1).mean(0)
    return total / run.keys.shape[0]


def reconstruction_passes(model: NuggetModel,
                          documents: Sequence[Sequence[int]]) -> list[tuple[FrozenPass, torch.Tensor]]:
    """Each document's frozen pass (its own positions come first) and its reconstruction scores."""
    prompt = repeat_prompt_ids(model)
    sequences = [list(ids) + prompt + list(ids) for ids in documents]
    return [(run, reconstruction_scores(model, run, len(ids)))
            for ids, run in zip(documents, frozen_pass(model, sequences, queries=True))]

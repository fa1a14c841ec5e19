"""Query-agnostic key/value selection: keep the k positions that the document's later tokens attend to most.

Re-implementation of kvpress's ObservedAttentionPress (H2O-style accumulated attention) for nugget states: in the
frozen model's pass over the document alone, position j scores the attention that tokens i >= j pay it, summed
over queries and divided by their number (n - j), averaged over heads and summed over layers. The top k =
ceil(n / r) positions are kept, one set shared by every layer and head (a NuggetState keeps one set of
positions); their keys/values are cached per document and reused by every question, like nuggets.
"""

from __future__ import annotations

import torch

from ._kv import attention_probs, frozen_pass, state_at
from .base import Env, Reading, Skipped, System, budget, per_document, register


def observed_scores(model, run) -> torch.Tensor:
    n = run.keys.shape[2]
    rows = torch.arange(n, device=run.keys.device)
    total = torch.zeros(n, device=run.keys.device)
    for layer in range(run.keys.shape[0]):
        probs = attention_probs(model, run, rows, layer)  # [heads, n, n]
        total += probs.mean(0).sum(0)
    return total / torch.arange(n, 0, -1, device=total.device)


@register("observed_attention")
class ObservedAttention(System):
    label = "Observed-attention KV selection (query-agnostic, re-impl.)"
    reimplementation = True
    description = __doc__.split("\n\n")[1].replace("\n", " ")

    def prepare(self, env: Env, queries, ratio):
        model = env.model

        def select(chunk):
            out = []
            for ids, run in zip(chunk, frozen_pass(model, chunk, queries=True)):
                chosen = observed_scores(model, run).topk(budget(len(ids), ratio)).indices
                out.append(state_at(model, run, chosen, ids, len(ids), f"observed-attention-r{ratio}"))
            return out

        return [Skipped("empty document") if states is None else Reading(states=states)
                for states in per_document(env, queries, f"{self.name}@{ratio}", select)]

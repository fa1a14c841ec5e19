"""Query-agnostic key/value selection: keep the k positions that the document's later tokens attend to most.

Re-implementation of kvpress's ObservedAttentionPress (H2O-style accumulated attention) for nugget states: in the
frozen model's pass over the document alone, position j scores the attention that tokens i >= j pay it, summed
over queries and divided by their number (n - j), averaged over heads and summed over layers. The top k =
ceil(n / r) positions are kept, one set shared by every layer and head (a NuggetState keeps one set of
positions); their keys/values are cached per document and reused by every question, like nuggets.
"""

from __future__ import annotations

from ...model.frozen_pass import frozen_pass
from ...model.importance import observed_scores
from ._kv import top_states
from .base import Env, Reading, Reimplementation, document_readings, register


@register("observed_attention")
class ObservedAttention(Reimplementation):
    label = "Observed-attention KV selection (query-agnostic, re-impl.)"

    def prepare(self, env: Env, queries, ratio):
        model = env.model

        def select(chunk):
            runs = frozen_pass(model, chunk, queries=True)
            return top_states(model, chunk, runs, [observed_scores(model, run) for run in runs], ratio,
                              "observed-attention")

        return document_readings(env, queries, f"{self.name}@{ratio}", select, lambda q, states: Reading(states=states))

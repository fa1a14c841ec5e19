"""Query-agnostic key/value selection by context reconstruction: keep what the model reads to repeat the document.

Re-implementation of KVzip (Kim et al., 2025; kvpress's KVzipPress) for nugget states: the frozen model reads the
document, then "Repeat the previous context exactly." and the document again (teacher-forced). Position j scores
the largest attention that any repeated token, in any query head of a key/value head's group, pays it (softmax
over the document, the prompt and the repeat), averaged over key/value heads and layers: one set of positions
for all layers and heads, where KVzip keeps one per head. The top k = ceil(n / r) positions are kept; their
keys/values come from the document's own pass, so they are cached per document and reused by every question,
like nuggets.
"""

from __future__ import annotations

from ...model.importance import reconstruction_passes, repeat_prompt_ids
from ._kv import top_states
from .base import Env, Reading, Reimplementation, Skipped, document_readings, register


@register("kvzip")
class KVzip(Reimplementation):
    label = "KVzip-style KV selection (query-agnostic, re-impl.)"

    def prepare(self, env: Env, queries, ratio):
        model = env.model
        limit = (model.max_positions - len(model.document_opening) - len(repeat_prompt_ids(model))) // 2
        fits = [all(len(ids) <= limit for ids in q.document_ids) for q in queries]

        def select(chunk):
            runs, scores = zip(*reconstruction_passes(model, chunk))
            return top_states(model, chunk, runs, scores, ratio, "kvzip")

        selected = iter(document_readings(env, [q for q, ok in zip(queries, fits) if ok], f"{self.name}@{ratio}",
                                          select, lambda q, states: Reading(states=states)))
        too_long = Skipped(f"a document over {limit} tokens: with its repeat it exceeds the model's positions")
        return [next(selected) if ok else too_long for ok in fits]

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

from collections.abc import Sequence

import torch

from ...model.frozen_pass import FrozenPass, attention_probs, frozen_pass
from ._kv import top_states
from .base import Env, Reading, Reimplementation, Skipped, document_readings, register

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


def repeat_prompt_ids(model) -> list[int]:
    return model.tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False)


def reconstruction_scores(model, run: FrozenPass, n: int) -> torch.Tensor:
    """[n] scores of the document's positions from a frozen pass over document + repeat prompt + document."""
    rows = torch.arange(run.keys.shape[2] - n, run.keys.shape[2], device=run.keys.device)
    kv_heads = run.keys.shape[1]
    total = torch.zeros(n, device=run.keys.device)
    for layer in range(run.keys.shape[0]):
        probs = attention_probs(model, run, rows, layer)[:, :, :n]  # [heads, n repeated, n]
        total += probs.view(kv_heads, -1, n).amax(1).mean(0)
    return total / run.keys.shape[0]


def reconstruction_passes(model, documents: Sequence[Sequence[int]]) -> list[tuple[FrozenPass, torch.Tensor]]:
    """Each document's frozen pass (its own positions come first) and its reconstruction scores."""
    prompt = repeat_prompt_ids(model)
    sequences = [list(ids) + prompt + list(ids) for ids in documents]
    return [(run, reconstruction_scores(model, run, len(ids)))
            for ids, run in zip(documents, frozen_pass(model, sequences, queries=True))]


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

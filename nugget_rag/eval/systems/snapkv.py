"""Query-aware key/value selection in the SnapKV style (Li et al., 2024): keep what the question attends to most.

Re-implementation for nugget states: each document is run through the frozen model followed by the observation
window, i.e. the prompt that will follow the states (the instruction in its user turn; for language modelling
the explicit context). Every window token's attention over the document's positions is summed, smoothed by an
average pool of width 7 (SnapKV's clustering), averaged over heads and summed over layers; the top
k = ceil(n / r) positions are kept, one set for all layers and heads. The states depend on the question, so
they cannot be cached across questions: a reference, not a cached compressor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...model.frozen_pass import attention_probs, frozen_pass
from ._kv import state_at
from .base import Env, Reading, Reimplementation, Skipped, budget, register

POOL = 7


def window_scores(model, run, n_doc: int) -> torch.Tensor:
    total_len = run.keys.shape[2]
    rows = torch.arange(n_doc, total_len, device=run.keys.device)
    total = torch.zeros(n_doc, device=run.keys.device)
    for layer in range(run.keys.shape[0]):
        probs = attention_probs(model, run, rows, layer)[:, :, :n_doc]  # [heads, window, n_doc]
        per_head = probs.sum(1)
        pooled = F.avg_pool1d(per_head[:, None], POOL, stride=1, padding=POOL // 2, count_include_pad=False)[:, 0]
        total += pooled[:, :n_doc].mean(0)
    return total


@register("snapkv")
class SnapKV(Reimplementation):
    label = "SnapKV-style KV selection (query-aware, re-impl.; reference)"
    reference = True

    def prepare(self, env: Env, queries, ratio):
        model = env.model
        out = []
        for q in queries:
            if any(len(ids) == 0 for ids in q.document_ids):
                out.append(Skipped("empty document"))
                continue
            # the observation window: what follows the documents in the prompt the decoder reads
            window = list(q.context_ids) if q.kind == "lm" else model.chat_prompt(
                [{"role": "user", "content": q.instruction}])[1]
            if not window:
                out.append(Skipped("no observation window (empty instruction)"))
                continue
            sequences = [list(ids) + window for ids in q.document_ids]
            states = []
            for start in range(0, len(sequences), env.batch_size):
                part = sequences[start : start + env.batch_size]
                for ids, run in zip(part, frozen_pass(model, part, queries=True)):
                    n = len(ids) - len(window)
                    chosen = window_scores(model, run, n).topk(budget(n, ratio)).indices
                    states.append(state_at(model, run, chosen, ids, n, f"snapkv-r{ratio}"))
            out.append(Reading(states=states))
        return out

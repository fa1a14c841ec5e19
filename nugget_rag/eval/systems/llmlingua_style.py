"""LLMLingua-style prompt pruning: keep each document's k = ceil(n / r) most surprising tokens, as text.

Re-implementation of LLMLingua's token-level step (Jiang et al., 2023) in one pass: a small LM (here the
frozen base model itself, already small) gives every token its surprisal -log p(x_i | x_<i); the first token,
which has no prediction, always stays; the k most surprising tokens are kept in their order and detokenised.
LLMLingua proper adds a budget controller and iterative segment-wise recomputation; the `llmlingua` peer
system runs the package itself.
"""

from __future__ import annotations

import torch

from .base import Env, Reimplementation, as_text, budget, document_readings, register


@torch.no_grad()
def surprisal(model, token_ids: list[list[int]]) -> list[torch.Tensor]:
    input_ids, mask = model.pad(token_ids)
    logits = model.logits(model.run(None, input_ids=input_ids, attention_mask=mask.long())).float()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    out = []
    for b, ids in enumerate(token_ids):
        s = torch.full((len(ids),), float("inf"), device=logits.device)
        s[1:] = -logp[b, : len(ids) - 1]
        out.append(s)
    return out


@register("llmlingua_style")
class LLMLinguaStyle(Reimplementation):
    label = "LLMLingua-style pruning (one-pass surprisal, re-impl.)"

    def prepare(self, env: Env, queries, ratio):
        def most_surprising(chunk):
            return [[ids[i] for i in s.topk(budget(len(ids), ratio)).indices.sort().values.tolist()]
                    for ids, s in zip(chunk, surprisal(env.model, [list(c) for c in chunk]))]

        return document_readings(env, queries, f"{self.name}@{ratio}", most_surprising,
                                 lambda q, kept: as_text(env, kept))

"""LLMLingua-style prompt pruning: keep each document's k = ceil(n / r) most surprising tokens, as text.

Re-implementation of LLMLingua's token-level step (Jiang et al., 2023) in one pass: a small LM (here the
frozen base model itself, already small) gives every token its surprisal -log p(x_i | x_<i); the first token,
which has no prediction, always stays; the k most surprising tokens are kept in their order and detokenised.
LLMLingua proper adds a budget controller and iterative segment-wise recomputation; the `llmlingua` peer
system runs the package itself.
"""

from __future__ import annotations

import torch

from .base import Env, Reading, Skipped, System, budget, register


@torch.no_grad()
def surprisal(model, token_ids: list[list[int]]) -> list[torch.Tensor]:
    input_ids, mask = model._pad(token_ids)
    with model.lock, model.use_adapter(None):
        logits = model.llama(input_ids=input_ids, attention_mask=mask.long(), use_cache=False).logits.float()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    out = []
    for b, ids in enumerate(token_ids):
        s = torch.full((len(ids),), float("inf"), device=logits.device)
        s[1:] = -logp[b, : len(ids) - 1]
        out.append(s)
    return out


@register("llmlingua_style")
class LLMLinguaStyle(System):
    label = "LLMLingua-style pruning (one-pass surprisal, re-impl.)"
    reimplementation = True
    description = __doc__.split("\n\n")[1].replace("\n", " ")

    def prepare(self, env: Env, queries, ratio):
        model = env.model
        cache = env.cache_for(f"{self.name}@{ratio}")
        todo = sorted({tuple(ids) for q in queries for ids in q.document_ids if ids and tuple(ids) not in cache}, key=len)
        for start in range(0, len(todo), env.batch_size):
            chunk = todo[start : start + env.batch_size]
            for ids, s in zip(chunk, surprisal(model, [list(c) for c in chunk])):
                keep = s.topk(budget(len(ids), ratio)).indices.sort().values.tolist()
                cache[ids] = [ids[i] for i in keep]
        out = []
        for q in queries:
            if any(len(ids) == 0 for ids in q.document_ids):
                out.append(Skipped("empty document"))
                continue
            kept = [cache[tuple(ids)] for ids in q.document_ids]
            out.append(Reading(texts=[model.tokenizer.decode(ids) for ids in kept], text_ids=kept))
        return out

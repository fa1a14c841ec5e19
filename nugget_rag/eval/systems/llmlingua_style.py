"""LLMLingua-style prompt pruning: keep each document's k = ceil(n / r) most surprising tokens, as text.

Re-implementation of LLMLingua's token-level step (Jiang et al., 2023) in one pass: a small LM (here the
frozen base model itself, already small) gives every token its surprisal -log p(x_i | x_<i); the first token,
which has no prediction, always stays; the k most surprising tokens are kept in their order and detokenised.
LLMLingua proper adds a budget controller and iterative segment-wise recomputation; the `llmlingua` peer
system runs the package itself.
"""

from __future__ import annotations

import torch

from .base import Env, Reading, Skipped, System, budget, per_document, register


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
class LLMLinguaStyle(System):
    label = "LLMLingua-style pruning (one-pass surprisal, re-impl.)"
    reimplementation = True
    description = __doc__.split("\n\n")[1].replace("\n", " ")

    def prepare(self, env: Env, queries, ratio):
        model = env.model

        def prune(chunk):
            out = []
            for ids, s in zip(chunk, surprisal(model, [list(c) for c in chunk])):
                keep = s.topk(budget(len(ids), ratio)).indices.sort().values.tolist()
                out.append([ids[i] for i in keep])
            return out

        return [Skipped("empty document") if kept is None
                else Reading(texts=[model.tokenizer.decode(ids) for ids in kept], text_ids=kept)
                for kept in per_document(env, queries, f"{self.name}@{ratio}", prune)]

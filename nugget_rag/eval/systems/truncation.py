"""Truncation: each document cut to its first k = ceil(n / r) tokens, as text."""

from __future__ import annotations

from .base import Env, Reading, Skipped, System, budget, register


@register("truncation")
class Truncation(System):
    label = "Truncation (first n/r tokens)"
    description = ("Each document's first ceil(n/r) tokens in Full's prompt. Language modelling keeps the history's "
                   "last ceil(n/r) tokens instead (the paper's Full at an equal number of states, Table 1).")

    def prepare(self, env: Env, queries, ratio):
        tok = env.model.tokenizer
        out = []
        for q in queries:
            if any(len(ids) == 0 for ids in q.document_ids):
                out.append(Skipped("empty document"))
                continue
            kept = [ids[-budget(len(ids), ratio):] if q.kind == "lm" else ids[: budget(len(ids), ratio)]
                    for ids in q.document_ids]
            out.append(Reading(texts=[tok.decode(ids) for ids in kept], text_ids=kept))
        return out

"""Truncation: each document cut to its first k = ceil(n / r) tokens, as text."""

from __future__ import annotations

from .base import Env, System, budget, kept_text, register


@register("truncation")
class Truncation(System):
    label = "Truncation (first n/r tokens)"
    description = ("Each document's first ceil(n/r) tokens in Full's prompt. Language modelling keeps the history's "
                   "last ceil(n/r) tokens instead (the paper's Full at an equal number of states, Table 1).")

    def prepare(self, env: Env, queries, ratio):
        def keep(ids, q):
            return ids[-budget(len(ids), ratio):] if q.kind == "lm" else ids[: budget(len(ids), ratio)]

        return kept_text(env, queries, keep)

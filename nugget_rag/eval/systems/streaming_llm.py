"""StreamingLLM (Xiao et al., 2024): attention sinks plus a recent window, training-free, as text.

Each document keeps its first 4 tokens (the sinks) and its last k - 4, k = ceil(n / r) as the nuggets' budget, at
contiguous positions, which is StreamingLLM's in-cache position scheme; the frozen model reads them in Full's
prompt (language modelling: before the context)."""

from __future__ import annotations

from .base import Env, Reimplementation, budget, kept_text, register

SINKS = 4


def sinks_and_recent(ids: list[int], keep: int) -> list[int]:
    """The first SINKS tokens and the last keep - SINKS (all of them when they fit)."""
    if keep >= len(ids):
        return list(ids)
    sinks = min(SINKS, keep)
    return list(ids[:sinks]) + list(ids[len(ids) - (keep - sinks):])


@register("streaming_llm")
class StreamingLLM(Reimplementation):
    label = "StreamingLLM (sinks + recent, re-impl.)"

    def prepare(self, env: Env, queries, ratio):
        return kept_text(env, queries, lambda ids, q: sinks_and_recent(ids, budget(len(ids), ratio)))

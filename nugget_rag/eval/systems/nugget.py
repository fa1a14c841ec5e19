"""nugget-rag (Dodo): the Scorer's top-k nuggets from the encoder adapter, read by the decoder adapter."""

from __future__ import annotations

import torch

from ...config import DECODER, ENCODER
from .base import Env, Reading, Skipped, System, register


@register("nugget")
class Nugget(System):
    label = "nugget-rag (Dodo)"
    description = ("Each document compressed alone into k = ceil(n/r) nuggets (encoder adapter + Scorer), cached per "
                   "document; the nuggets of all documents composed in order and read by the decoder adapter "
                   "(autoencoding: after the soft prompt, with an empty prompt).")

    def prepare(self, env: Env, queries, ratio):
        model = env.model
        cache = env.cache_for(f"{self.name}@{ratio}")
        todo = sorted({tuple(ids) for q in queries for ids in q.document_ids if ids and tuple(ids) not in cache}, key=len)
        for start in range(0, len(todo), env.batch_size):
            chunk = todo[start : start + env.batch_size]
            with torch.inference_mode():
                states = model.compress([list(c) for c in chunk], ratio=ratio, adapter=ENCODER)
            cache.update(zip(chunk, states))
        return [Skipped("empty document") if any(len(ids) == 0 for ids in q.document_ids)
                else Reading(states=[cache[tuple(ids)] for ids in q.document_ids], adapter=DECODER,
                             soft_prompt=q.kind == "autoencoding")
                for q in queries]

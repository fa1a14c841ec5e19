"""nugget-rag (Dodo): the Scorer's top-k nuggets from the encoder adapter, read by the decoder adapter."""

from __future__ import annotations

import torch

from ...config import DECODER, ENCODER
from .base import Env, Reading, Skipped, System, per_document, register


@register("nugget")
class Nugget(System):
    label = "nugget-rag (Dodo)"
    description = ("Each document compressed alone into k = ceil(n/r) nuggets (encoder adapter + Scorer), cached per "
                   "document; the nuggets of all documents composed in order and read by the decoder adapter "
                   "(autoencoding: after the soft prompt, with an empty prompt).")

    def prepare(self, env: Env, queries, ratio):
        def compress(chunk):
            with torch.inference_mode():
                return env.model.compress([list(c) for c in chunk], ratio=ratio, adapter=ENCODER)

        return [Skipped("empty document") if states is None
                else Reading(states=states, adapter=DECODER, soft_prompt=q.kind == "autoencoding")
                for q, states in zip(queries, per_document(env, queries, f"{self.name}@{ratio}", compress))]

"""nugget-rag (Dodo): the Scorer's top-k nuggets from the encoder adapter, read by the decoder adapter."""

from __future__ import annotations

import torch

from ...components.compressor import NuggetCompressor
from ...config import DECODER, ENCODER
from .base import Env, Reading, System, document_readings, register


@register("nugget")
class Nugget(System):
    label = "nugget-rag (Dodo)"
    description = ("Each document compressed alone into k = ceil(n/r) nuggets (encoder adapter + Scorer), stored as "
                   "NuggetCompressor stores them (bfloat16 keys/values); the nuggets of all documents composed in "
                   "order and read by the decoder adapter (autoencoding: after the soft prompt, with an empty prompt).")
    kv_format = NuggetCompressor.model_fields["kv_format"].default

    def prepare(self, env: Env, queries, ratio):
        def compress(chunk):
            with torch.inference_mode():
                states = env.model.compress([list(c) for c in chunk], ratio=ratio, adapter=ENCODER)
            return [state.compact(self.kv_format) for state in states]

        return document_readings(env, queries, f"{self.name}@{ratio}", compress, lambda q, states: Reading(
            states=states, adapter=DECODER, soft_prompt=q.kind == "autoencoding"))


def stored_as(kv_format: str, label: str, description: str) -> type[Nugget]:
    """nugget-rag with its states stored in another format, registered as `nugget_<format>` (not run by default)."""
    variant = type(f"Nugget{kv_format.capitalize()}", (Nugget,), {
        "label": label, "description": description, "kv_format": kv_format, "in_default": False})
    return register(f"nugget_{kv_format}")(variant)


stored_as("float32", "nugget-rag, float32 states",
          "As nugget-rag, with the nuggets' keys/values kept in float32 (twice bfloat16's bytes).")
stored_as("int8", "nugget-rag, int8 states",
          "As nugget-rag, with the nuggets' keys quantised to int8 per channel and values per token "
          "(half bfloat16's bytes).")
stored_as("int4", "nugget-rag, int4 states",
          "As nugget-rag, with the nuggets' keys quantised to 4 bits per channel and values per token, two "
          "codes a byte (a quarter of bfloat16's bytes).")

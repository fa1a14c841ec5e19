"""nugget-rag (Dodo): the Scorer's top-k nuggets from the encoder adapter, read by the decoder adapter."""

from __future__ import annotations

import torch

from ...compressor import NuggetCompressor
from ...config import DECODER, ENCODER
from .base import Env, Reading, Skipped, System, per_document, register


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

        return [Skipped("empty document") if states is None
                else Reading(states=states, adapter=DECODER, soft_prompt=q.kind == "autoencoding")
                for q, states in zip(queries, per_document(env, queries, f"{self.name}@{ratio}", compress))]


@register("nugget_float32")
class NuggetFloat32(Nugget):
    label = "nugget-rag, float32 states"
    description = "As nugget-rag, with the nuggets' keys/values kept in float32 (twice bfloat16's bytes)."
    kv_format = "float32"
    in_default = False


@register("nugget_int8")
class NuggetInt8(Nugget):
    label = "nugget-rag, int8 states"
    description = ("As nugget-rag, with the nuggets' keys quantised to int8 per channel and values per token "
                   "(half bfloat16's bytes).")
    kv_format = "int8"
    in_default = False


@register("nugget_int4")
class NuggetInt4(Nugget):
    label = "nugget-rag, int4 states"
    description = ("As nugget-rag, with the nuggets' keys quantised to 4 bits per channel and values per token, two "
                   "codes a byte (a quarter of bfloat16's bytes).")
    kv_format = "int4"
    in_default = False

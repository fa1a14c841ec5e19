"""nugget-rag in autoregressive mode (paper Sec. 2.2): each document read left to right by a NuggetStream, whose
segments are encoded after the nuggets of the earlier ones and a whole window, then its nuggets read by the decoder
adapter as compressor mode's are. Language modelling is then Table 1's setting: the history's nuggets, the context
whole, the target scored."""

from __future__ import annotations

import torch

from ...config import DECODER, StreamSettings
from ...generation.autoregressive import NuggetStream
from .base import Env, Reading, Skipped, System, per_document, register


@register("nugget_autoregressive")
class NuggetAutoregressive(System):
    label = "nugget-rag, autoregressive mode"
    kinds = frozenset({"qa", "summarization", "lm"})
    description = ("Each document read by a NuggetStream (window and segments of 128 tokens; every segment keeps "
                   "ceil(segment/r) nuggets, encoded after the earlier nuggets and the window); all its nuggets "
                   "then read by the decoder adapter like compressor mode's.")
    reading = StreamSettings()

    def prepare(self, env: Env, queries, ratio):
        stream = NuggetStream(env.model, self.reading.model_copy(update={"ratio": ratio}))

        def read(chunk):
            states = []
            for ids in chunk:
                stream.reset()
                with torch.inference_mode():
                    stream.feed(ids)
                    stream.flush()
                    states.append(stream.to_state())
            return states

        return [Skipped("empty document") if states is None else Reading(states=states, adapter=DECODER)
                for states in per_document(env, queries, f"{self.name}@{ratio}", read)]

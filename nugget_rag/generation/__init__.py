"""Decoding from nuggets: incremental generation (greedy or sampled, stop strings, streaming), static-shape and
batched decoding across requests, and autoregressive compression of a growing stream."""

from .decoding import GenerationSettings, eos_ids, generate, generation_steps, stream_generate

__all__ = ["GenerationSettings", "eos_ids", "generate", "generation_steps", "stream_generate"]

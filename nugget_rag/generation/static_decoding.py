"""Decoding over a static KV cache, its per-token step compiled: CUDA graphs on CUDA.

The nuggets and the prompt fill a preallocated cache (transformers' `StaticCache`) and every later step writes one
token per row into it, so a step's shapes never change. `torch.compile(mode="reduce-overhead")` then records the step
once as a CUDA graph and replays it, where eager decoding launches a few hundred kernels a token (on an H200, 17-22
ms a token for the 135M default model, against ~0.1 ms to read its weights).

Rows that finish stay in the batch, their tokens unread: a new batch size would need a new graph, and a decoding step
at small batch is bound by reading the weights, so an idle row costs little.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING

import torch
from transformers import StaticCache

if TYPE_CHECKING:
    from ..model.nugget_model import NuggetModel

CAPACITY_STEP = 256  # caches are sized in steps of this many positions, so that similar requests share one graph


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its inner LLaMA, compiled once


def compiled_inner(model: NuggetModel) -> torch.nn.Module:
    """The model's inner LLaMA through torch.compile's "reduce-overhead" mode (CUDA graphs on CUDA)."""
    if model not in _COMPILED:
        _COMPILED[model] = torch.compile(model.llama.model, mode="reduce-overhead")
    return _COMPILED[model]


class StaticDecoding:
    """A batch's KV cache with room for `room` more tokens a row: the nuggets (`keys`/`values`, [layers, batch,
    kv_heads, K, head_dim], `present` [batch, K] False on padding) and then every token run through `run`."""

    def __init__(self, model: NuggetModel, keys: torch.Tensor, values: torch.Tensor, present: torch.Tensor,
                 room: int, compiled: bool):
        nuggets = keys.shape[3]
        capacity = math.ceil((nuggets + room) / CAPACITY_STEP) * CAPACITY_STEP
        self.cache = StaticCache(config=model.llama.config, max_cache_len=capacity)
        for layer, key, value in zip(self.cache.layers, keys, values):
            layer.update(key, value)
        self.seen = present.new_zeros(present.shape[0], capacity)  # True where a row has a real key
        self.seen[:, :nuggets] = present
        self.columns = torch.arange(capacity, device=present.device)
        self.compiled = compiled

    @property
    def length(self) -> torch.Tensor:
        """Keys cached so far (a 0-d tensor on the model's device: reading it never waits for the device)."""
        return self.cache.layers[0].cumulative_length

    def run(self, model: NuggetModel, adapter: str | None, embeds: torch.Tensor, positions: torch.Tensor,
            token_mask: torch.Tensor) -> torch.Tensor:
        """The hidden states of `embeds` ([batch, q, hidden]; `token_mask` [batch, q] False on padding), cached.
        One token a row runs compiled (with `compiled`); the prompt, run once, does not."""
        start = self.length
        new = start + torch.arange(embeds.shape[1], device=embeds.device)
        self.seen.index_copy_(1, new, token_mask.to(self.seen.dtype))
        causal = self.columns[None, :] <= new[:, None]  # [q, capacity]
        mask = self.seen[:, None, None, :] & causal[None, None]  # [batch, 1, q, capacity]: a mask transformers keeps
        inner = compiled_inner(model) if self.compiled and embeds.shape[1] == 1 else None
        return model.run(adapter, inner=inner, inputs_embeds=embeds, position_ids=positions, cache=self.cache,
                         attention_mask=mask)

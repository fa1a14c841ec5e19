"""Prompt prefixes run as rows of the decoder's own pass, where no prefix state is kept (under autograd: training).

The decoder reads a sample's prompt prefix (by default the chat template's opening, h tokens) as key/value states at
positions 0..h-1, before its nuggets (layout.py). Without autograd those states come from `PrefixCache`: computed
once in a pass of their own and kept. Under autograd nothing is kept, and that pass, a few tokens through every
layer forward and backward, costs a training step as many operations (kernel launches on a GPU) as the decoder's
pass itself. So there each distinct prefix runs instead as one more row of the decoder's batch, at positions
0..h-1, attending causally to itself alone; `compose` leaves zero placeholders in the samples' head slots, and in
every layer `ReadWithPrefixRows` fills them with the prefix row's keys and values as that layer computes them. Each
token reads the same states as from a separate pass (the same positions, adapter and attention) and the gradient
reaches the adapter through them; only the order of floating-point sums differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..state.nugget_state import NuggetState
from .attention import ReadNuggets

PLACEHOLDER = "prompt-prefix-row"  # the fingerprint of a head slot's placeholder (never stored, never checked)


@dataclass
class PrefixRows:
    """The distinct prompt prefixes of a batch as rows of its decoder pass, after the samples' own rows."""

    ids: torch.Tensor  # [prefixes, width]: each distinct prefix's token ids, right-padded
    owners: torch.Tensor  # [samples]: the prefix row each sample reads (0 for a sample without one)
    heads: torch.Tensor  # [samples]: each sample's prefix length h, its head slots 0..h-1 (0: none)

    @classmethod
    def of(cls, prefixes: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> PrefixRows | None:
        """The rows for these samples' prefixes (equal ones share a row); None when every prefix is empty."""
        unique = list(dict.fromkeys(tuple(p) for p in prefixes if len(p)))
        if not unique:
            return None
        ids = torch.full((len(unique), max(map(len, unique))), pad_id, dtype=torch.long)
        for row, prefix in enumerate(unique):
            ids[row, : len(prefix)] = torch.tensor(prefix, dtype=torch.long)
        index = {prefix: row for row, prefix in enumerate(unique)}
        owners = torch.tensor([index.get(tuple(p), 0) for p in prefixes], dtype=torch.long)
        heads = torch.tensor([len(p) for p in prefixes], dtype=torch.long)
        return cls(ids.to(device), owners.to(device), heads.to(device))

    def placeholders(self, prefixes: Sequence[Sequence[int]], empty: torch.Tensor) -> list[NuggetState | None]:
        """Each sample's head as zero states at positions 0..h-1 (None without a prefix), for `compose` to lay out;
        the pass fills them layer by layer. `empty`: layout.no_states of the decoder's dtype and device."""
        layers, kv_heads, _, head_dim = empty.shape

        def placeholder(n: int) -> NuggetState:
            zeros = empty.new_zeros(layers, kv_heads, n, head_dim)
            steps = torch.arange(n, device=empty.device)
            return NuggetState(zeros, zeros, steps, torch.zeros(n, device=empty.device), [], n, PLACEHOLDER)

        return [placeholder(len(p)) if len(p) else None for p in prefixes]

    def inputs(self, embeds: torch.Tensor, token_mask: torch.Tensor, positions: torch.Tensor,
               embedding: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pass's input embeddings and positions, the samples' rows then the prefixes' (0..h-1), right-padded to
        one width; and the samples' token mask at that width (what their reader is built for)."""
        width = max(embeds.shape[1], self.ids.shape[1])
        grow, short = width - embeds.shape[1], width - self.ids.shape[1]
        rows = embedding(self.ids).to(embeds.dtype)
        steps = torch.arange(self.ids.shape[1], device=positions.device).expand(len(self.ids), -1)
        embeds = torch.cat([F.pad(embeds, (0, 0, 0, grow)), F.pad(rows, (0, 0, 0, short))])
        positions = torch.cat([F.pad(positions, (0, grow)), F.pad(steps, (0, short))])
        return embeds, F.pad(token_mask, (0, grow)), positions


class ReadWithPrefixRows:
    """A reader (`inner`, built for the samples' rows) for a pass whose last rows are `rows`' prefixes: those attend
    causally to themselves alone; in every layer their keys and values fill the samples' head slots, which the
    samples' tokens then read through `inner` as they read any nugget."""

    inline = False  # traced into the caller's torch.compile graph (attention.nugget_attention)

    def __init__(self, inner: ReadNuggets, rows: PrefixRows):
        self.inner, self.rows = inner, rows
        self.samples = len(rows.owners)
        slots = inner.keys.shape[3]
        self.width = rows.ids.shape[1]
        self.slots = (torch.arange(slots, device=rows.heads.device) < rows.heads[:, None])[:, None, :, None]
        self.grow = (0, 0, 0, slots - self.width)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               dropout: float) -> torch.Tensor:
        b = self.samples  # the samples' rows come first, the prefixes' after them
        own = F.scaled_dot_product_attention(query[b:], key[b:], value[b:], dropout_p=dropout, is_causal=True,
                                             scale=scale, enable_gqa=query.shape[1] != key.shape[1])
        keys, values = self.inner.layer_states(layer)
        # each sample's head slots take its prefix row's keys and values as computed at positions 0..h-1 (where the
        # layout's rotation leaves them unmoved); the gradient flows back into that row and the adapter
        head_keys = F.pad(key[b:, :, : self.width][self.rows.owners], self.grow)
        head_values = F.pad(value[b:, :, : self.width][self.rows.owners], self.grow)
        states = (torch.where(self.slots, head_keys, keys.to(head_keys.dtype)),
                  torch.where(self.slots, head_values, values.to(head_values.dtype)))
        read = self.inner.attend(layer, query[:b], key[:b], value[:b], scale, dropout, states)
        return torch.cat([read, own.to(read.dtype)])

"""The frozen model's pass over documents: what the training-free key/value baselines (the harness's) and the Scorer
warm start score a document's positions by.

`frozen_pass` runs the base model (adapters off) over right-padded token ids (after the document opening, as
NuggetModel.compress does) and returns, per row, every layer's keys (rotated by RoPE at their positions in the
document, as NuggetStates store them) and values at all positions, and optionally every layer's rotated queries
(a forward hook on q_proj); `attention_probs` is the attention those queries pay the document's positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import CaptureNuggets, rotate_keys
from .nugget_model import NuggetModel


@dataclass
class FrozenPass:
    keys: torch.Tensor  # [layers, kv_heads, n, head_dim], rotated at positions 0..n-1
    values: torch.Tensor
    queries: torch.Tensor | None  # [layers, heads, n, head_dim], rotated; None unless asked


@torch.no_grad()
def frozen_pass(model: NuggetModel, token_ids: Sequence[Sequence[int]], queries: bool = False) -> list[FrozenPass]:
    lengths = [len(t) for t in token_ids]
    input_ids, opening = model.encoder_input(token_ids)
    width = input_ids.shape[1] - opening
    positions = torch.arange(opening, opening + width, device=input_ids.device)[None].expand(len(token_ids), -1)
    capture = CaptureNuggets(positions)
    cfg = model.llama.config
    heads, head_dim = cfg.num_attention_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    recorded: dict[int, torch.Tensor] = {}
    hooks = []
    if queries:
        for index, layer in enumerate(model.layers):
            def hook(module, args, output, index=index):
                recorded[index] = output.detach().view(output.shape[0], output.shape[1], heads, head_dim).transpose(1, 2)
            hooks.append(layer.self_attn.q_proj.register_forward_hook(hook))
    try:
        model.run(None, capture, input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    keys, values = capture.stacked()  # [layers, batch, kv_heads, width, head_dim]
    keys = model.to_document_positions(keys, opening)
    q_all = None
    if queries:
        inv_freq = model.inv_freq
        # [layers, batch, heads, width, head_dim], the document's rows
        q_all = torch.stack([recorded[i][:, :, opening:] for i in sorted(recorded)])
        q_all = rotate_keys(q_all, torch.arange(width, device=q_all.device), inv_freq)
    return [FrozenPass(keys[:, b, :, :n], values[:, b, :, :n], None if q_all is None else q_all[:, b, :, :n])
            for b, n in enumerate(lengths)]


def attention_probs(model: NuggetModel, run: FrozenPass, rows: torch.Tensor, layer: int) -> torch.Tensor:
    """Causal attention probabilities [heads, len(rows), n] of the query rows over the document's positions, in
    one layer (normalised over the document: the document opening's columns are left out)."""
    q = run.queries[layer][:, rows].float()  # [heads, R, D]
    k = run.keys[layer].float()  # [kv_heads, n, D]
    groups = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(groups, dim=0)
    scale = model.layers[layer].self_attn.scaling
    logits = q @ k.transpose(1, 2) * scale
    cols = torch.arange(k.shape[1], device=logits.device)
    logits = logits.masked_fill(cols[None, None, :] > rows[None, :, None], float("-inf"))
    return logits.softmax(-1)

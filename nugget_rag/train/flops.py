"""Model FLOPs of a training step, for model-FLOPs utilisation (MFU): the FLOPs its passes require, from their
token counts, over the time the step took and the accelerator's peak.

A forward pass costs 2 FLOPs per multiply-add in every linear layer, in the attention scores and the weighted
values (each token over the positions it reads), and in the output layer at the target tokens only. A pass that
is backpropagated costs as much again (activation gradients; the base model's weights are frozen, so there are no
weight gradients but the adapters' few). Padding is not counted: it is time spent on no work, which MFU shows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# dense bf16 tensor-core peaks, TFLOP/s (vendor data sheets)
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0, "A100": 312.0}


class FlopCounter:
    """FLOPs of passes through a LLaMA (its config: layers, widths, vocabulary)."""

    def __init__(self, config):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        d, q, kv = config.hidden_size, config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        self.layers = config.num_hidden_layers
        self.linear = 2 * (d * q + 2 * d * kv + q * d + 3 * d * config.intermediate_size)  # per token and layer
        self.attention = 4 * q  # per token, layer and position read (scores and values)
        self.output = 2 * d * config.vocab_size  # per target token

    def forward(self, rows: Iterable[tuple[int, int]], layers: int | None = None, targets: int = 0) -> float:
        """A forward pass over `rows` of (tokens, cached positions before them) through `layers` layers (all by
        default), with output logits at `targets` tokens."""
        per_layer = 0
        for tokens, cached in rows:
            read = tokens * cached + tokens * (tokens + 1) // 2  # causal: token i reads cached + i + 1 positions
            per_layer += self.linear * tokens + self.attention * read
        return float((layers if layers is not None else self.layers) * per_layer + self.output * targets)

    def trained(self, rows: Iterable[tuple[int, int]], targets: int = 0) -> float:
        """A forward and backward pass (activation gradients) over all layers."""
        return 2 * self.forward(rows, targets=targets)


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """The accelerator's dense bf16 peak in FLOP/s: `override_tflops`, else a known GPU's, else None."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS.items() if key in name), None)

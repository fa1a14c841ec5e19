"""int8 weights for decoding on a CPU: each weight row quantised once to int8 with a scale (weight-only, so the
inputs keep their precision), multiplied by torch's int8-weight kernel in bfloat16.

Decoding a token reads every weight once, so a CPU spends it waiting on memory; an int8 weight is a quarter of
float32's bytes. Quantising the inputs too (torch's dynamic quantisation) is faster still but breaks on LLaMA's
outlier channels (next-token KL 1.44 against 0.0066, BENCHMARKS.md "int8 weights for CPU decoding"). A pass over many rows
(a prompt) runs on the float weight, where the int8 kernel is slower than float32's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_INT8_ROWS = 16  # rows (tokens x batch) up to which a pass takes the int8 kernel: decoding steps, small batches


def check_int8_support(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, naming the fix, where the int8 kernel cannot run."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"int8 weights are for float32 models on a CPU; this one is {dtype} on {device}: "
                         "use weights='float'".replace("torch.", ""))
    if not hasattr(torch, "_weight_int8pack_mm"):
        raise ValueError(f"torch {torch.__version__} has no int8-weight kernel (torch._weight_int8pack_mm): "
                         "use weights='float', or torch >= 2.4")


class Int8Linear(nn.Module):
    """y = x W^T + b, with W as int8 rows and a bfloat16 scale each for passes of few rows; W itself otherwise."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        w = self.weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.int8 = torch.round(w / scale[:, None]).to(torch.int8)
        self.scale = scale.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_INT8_ROWS:
            return F.linear(x, self.weight, self.bias)
        y = torch._weight_int8pack_mm(rows.to(torch.bfloat16), self.int8, self.scale).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows"

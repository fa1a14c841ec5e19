"""The one attention function Dodo needs, registered with transformers' AttentionInterface.

Nugget data travels as a keyword argument (``nuggets=``) from the model's forward down to every attention
call. That keeps it out of the KV cache, which transformers drops under gradient checkpointing, and lets a
single code path serve training and generation:

- ``CaptureNuggets`` (encoder pass): plain causal attention; each layer's keys and values at the selected
  positions are recorded.
- ``ReadNuggets`` (decoder pass): each layer's nugget keys/values are put before the decoder's own, under one
  additive float mask. On nugget columns the mask holds ``s - s.detach()`` (paper Eq. 18): zero in the
  forward pass, and the gradient of every attention logit on a nugget key, in every layer and head, flows to
  the Scorer's score ``s``. This is the reference path.
- ``BiasChannelNuggets`` (training's decoder pass on CUDA): the same attention without a float mask, so that SDPA
  runs its fused kernels; the bias rides in one extra query/key channel.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTENTION_NAME = "nugget_sdpa"


@dataclass
class CaptureNuggets:
    """Records every layer's key/value states at `positions` ([batch, k]) during an encoder pass; causal, or under
    `mask` (boolean, [batch, 1, tokens, tokens]: packed rows, packing.py)."""

    positions: torch.Tensor
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    mask: torch.Tensor | None = None
    inline: bool = False  # traced into the caller's torch.compile graph (nugget_attention), not left out of it

    def extend(self, layer: int, key: torch.Tensor, value: torch.Tensor, query_len: int):
        index = self.positions[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
        # Assignment, not append: a gradient-checkpointing replay overwrites with equal tensors.
        self.keys[layer] = key.gather(2, index)
        self.values[layer] = value.gather(2, index)
        return key, value, None

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               dropout: float) -> torch.Tensor:
        key, value, _ = self.extend(layer, key, value, query.shape[2])
        return _sdpa(query, key, value, self.mask, scale, dropout)  # causal attention over the document alone

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as [layers, batch, kv_heads, k, head_dim]."""
        layers = sorted(self.keys)
        return torch.stack([self.keys[i] for i in layers]), torch.stack([self.values[i] for i in layers])


class ReadNuggets:
    """Nugget keys/values ([layers, batch, kv_heads, K, head_dim]) that the decoder's tokens attend to.

    `nugget_bias` is [batch, K]: the straight-through term on valid nuggets, -inf on padding.
    `token_mask` is [batch, tokens seen so far] (True = real token): the decoder's own padding; the last
    `query_len` of those tokens are the ones being run. The mask is built here, once, outside any
    gradient-checkpointed layer, so that a replay sees exactly the same graph.
    """

    inline = False  # traced into the caller's torch.compile graph (nugget_attention), not left out of it

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, nugget_bias: torch.Tensor,
                 token_mask: torch.Tensor, query_len: int):
        self.keys, self.values = keys, values
        self.mask = self._build_mask(nugget_bias, token_mask, query_len, keys.dtype)

    def extend(self, layer: int, key: torch.Tensor, value: torch.Tensor, query_len: int,
               states: tuple[torch.Tensor, torch.Tensor] | None = None):
        nugget_keys, nugget_values = self.layer_states(layer) if states is None else states
        key = torch.cat([nugget_keys.to(key.dtype), key], dim=2)
        value = torch.cat([nugget_values.to(value.dtype), value], dim=2)
        return key, value, self.mask.to(key.dtype)

    def layer_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The nugget keys and values that layer `layer`'s tokens read ([batch, kv_heads, K, head_dim] each)."""
        return self.keys[layer], self.values[layer]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               dropout: float, states: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Attention of the tokens being run over the nuggets (`states`, default `layer_states(layer)`) and
        themselves."""
        key, value, mask = self.extend(layer, key, value, query.shape[2], states)
        return _sdpa(query, key, value, mask, scale, dropout)

    @staticmethod
    def _build_mask(nugget_bias: torch.Tensor, token_mask: torch.Tensor, query_len: int, dtype: torch.dtype):
        seen = token_mask.shape[1]
        device = token_mask.device
        rows = torch.arange(seen - query_len, seen, device=device)[:, None]
        cols = torch.arange(seen, device=device)[None, :]
        allowed = (cols <= rows)[None] & token_mask[:, None, :]
        allowed |= cols == rows  # a padding row attends to itself rather than to nothing
        blocked = torch.finfo(dtype).min
        token_part = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, blocked)
        nugget_part = nugget_bias.to(dtype).clamp(min=blocked)[:, None, :].expand(-1, query_len, -1)
        return torch.cat([nugget_part, token_part], dim=2)[:, None]


class ReadAndRecord(ReadNuggets):
    """ReadNuggets that also records every layer's keys and values of the tokens being run (autoregressive mode:
    they become the next segment's window, and its nuggets)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded = CaptureNuggets(torch.zeros(0))

    def extend(self, layer: int, key: torch.Tensor, value: torch.Tensor, query_len: int,
               states: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.recorded.keys[layer], self.recorded.values[layer] = key, value  # assignment: replays overwrite
        return super().extend(layer, key, value, query_len, states)


class BiasChannelNuggets(ReadNuggets):
    """ReadNuggets without a float mask, so that SDPA can pick a fused kernel (flash, cuDNN or memory-efficient) with
    grouped heads; the float mask that requires grad gets none of them. Same output on every real token, same gradients.

    The Eq. 18 bias rides in one extra channel: every query gets 1/scale there, nugget key j gets b_j, token keys
    and values get 0, so each logit on a nugget key gains exactly b_j (zero forward) and its gradient reaches b_j.
    Causality is SDPA's lower-right causal mask; a padded nugget gets `PADDING_BIAS`, finite, never -inf. Needs
    the decoder's tokens right-padded (a padding row then sees only what is before it, never a real row) and run in
    one pass: training's decoder forward (`fits`).
    """

    PADDING_BIAS = -30_000.0  # softmax weight 0 in float32 and bfloat16, and within float16's range

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, nugget_bias: torch.Tensor,
                 token_mask: torch.Tensor, query_len: int, traced: bool = False):
        """`traced`: built inside a torch.compile graph (the compiled step, whose tokens are right-padded by
        construction): no check that reads tensors back from the device, causality as a boolean mask (dynamo does not
        trace `CausalBias`) and, on CUDA, grouped heads repeated for the memory-efficient kernel, which takes it."""
        if not traced and not self.fits(token_mask, query_len):
            raise ValueError("BiasChannelNuggets needs right-padded tokens run in one pass; use ReadNuggets")
        padding = torch.isneginf(nugget_bias)
        if not traced and not torch.isfinite(nugget_bias[~padding]).all():
            raise ValueError("a nugget's attention bias is not finite (NaN or inf): the Scorer's scores are; check "
                             "the Scorer's weights and inputs")
        self.keys, self.values = keys, values
        self.channel = nugget_bias.masked_fill(padding, self.PADDING_BIAS)[:, None, :, None].to(keys.dtype)  # [b,1,K,1]
        seen = keys.shape[3] + query_len
        self.traced = traced
        if takes_causal_flag(token_mask.device) and not traced:
            self.causal = causal_lower_right(query_len, seen)
        else:
            self.causal = torch.ones(query_len, seen, dtype=torch.bool, device=token_mask.device).tril(seen - query_len)

    @staticmethod
    def fits(token_mask: torch.Tensor, query_len: int) -> bool:
        """Whether tokens with `token_mask` ([batch, seen]) are right-padded (or not padded) and all run now."""
        return query_len == token_mask.shape[1] and bool((token_mask[:, 1:] <= token_mask[:, :-1]).all())

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               dropout: float, states: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # One dtype for all three: under autocast RoPE's float32 cos/sin leave q and k float32 while v is already in
        # the autocast dtype, and the `CausalBias` dispatch checks dtypes before autocast casts anything.
        dtype = torch.get_autocast_dtype(query.device.type) if torch.is_autocast_enabled(query.device.type) else value.dtype
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        nugget_keys, nugget_values = self.layer_states(layer) if states is None else states
        nugget_keys = nugget_keys.to(dtype)
        bias = self.channel.to(dtype).expand(-1, nugget_keys.shape[1], -1, -1)
        key = torch.cat([torch.cat([nugget_keys, bias], dim=-1), F.pad(key, (0, 1))], dim=2)
        value = F.pad(torch.cat([nugget_values.to(value.dtype), value], dim=2), (0, 1))
        query = torch.cat([query, query.new_full((*query.shape[:-1], 1), 1 / scale)], dim=-1)
        groups = query.shape[1] // key.shape[1]
        if groups > 1 and query.device.type == "cuda" and (self.traced or not flash_takes_groups(query, key, value)):
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=self.causal, dropout_p=dropout, scale=scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out[..., :-1]


def takes_causal_flag(device: torch.device) -> bool:
    """Whether the fused reader gives SDPA lower-right causality as a flag (`CausalBias`, CUDA's fused kernels) rather
    than a boolean mask (the CPU's kernels)."""
    return device.type == "cuda"


def flash_takes_groups(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether CUDA's flash kernel runs these grouped heads; the other fused kernels need them repeated."""
    params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, False, True)
    return torch.backends.cuda.can_use_flash_attention(params)


def nugget_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    nuggets: CaptureNuggets | ReadNuggets | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with an optional nugget prefix; causal by default. Returns [batch, q, heads, head_dim].

    Without `nuggets` (a plain forward of the base model) it is transformers' SDPA with the mask transformers
    built, so padding and KV caches work as they do for the unwrapped model.
    """
    if nuggets is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    attend = _attend_nuggets if nuggets.inline else _attend_nuggets_left_out
    return attend(nuggets, module.layer_idx, query, key, value, scaling, dropout)


def _attend_nuggets(nuggets: CaptureNuggets | ReadNuggets, layer: int, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, scaling: float | None, dropout: float) -> tuple[torch.Tensor, None]:
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = nuggets.attend(layer, query, key, value, scale, dropout)
    return out.transpose(1, 2).contiguous(), None


# Left out of torch.compile unless the nugget object is `inline` (the compiled training step traces everything in one
# graph): under per-layer compilation (compiled_step.compile_layers) the nugget objects it records into and each layer's
# index would make every layer its own compiled variant. A plain pass (decoding over a static cache) compiles whole.
_attend_nuggets_left_out = torch.compiler.disable(_attend_nuggets)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
          dropout: float) -> torch.Tensor:
    """SDPA over grouped heads: under `mask`, or causal without one."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and mask is not None and repeat_masked_gqa(query.device):
        key, value, groups = repeat_kv(key, groups), repeat_kv(value, groups), 1
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                          scale=scale, enable_gqa=groups > 1)


def repeat_masked_gqa(device: torch.device) -> bool:
    """Whether grouped keys/values under a mask are repeated to one head per query head before SDPA: on CUDA, whose
    fused kernels take either a mask or grouped heads, and fall back to the math kernel (scores materialised in
    float32) when given both (transformers' `use_gqa_in_sdpa` makes the same choice)."""
    return device.type == "cuda"


_NUGGET_FORWARD: ContextVar[bool] = ContextVar("nugget_forward", default=False)


def _note_nugget_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    _NUGGET_FORWARD.set(kwargs.get("nuggets") is not None)


def install(model: torch.nn.Module) -> None:
    """Make a LLaMA model (the inner `LlamaModel`) attend with `nugget_attention`.

    Each forward notes whether it carries nuggets: those build their own mask, so transformers is spared building
    (and discarding) one; plain forwards get transformers' SDPA mask as usual.
    """
    model.config._attn_implementation = ATTENTION_NAME
    model.register_forward_pre_hook(_note_nugget_forward, with_kwargs=True)


def _mask(*args, **kwargs) -> torch.Tensor | None:
    return None if _NUGGET_FORWARD.get() else sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTENTION_NAME, nugget_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _mask)


def rotate_keys(keys: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move RoPE keys by `shift` positions (exact: RoPE(p + d) = R(d) RoPE(p)).

    keys: [..., k, head_dim]; shift: [k], or any shape that broadcasts to keys' [..., k] (integer positions);
    inv_freq: [head_dim / 2].
    """
    angles = shift.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(keys.dtype), angles.sin().to(keys.dtype)
    half = keys.shape[-1] // 2
    rotated_half = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return keys * cos + rotated_half * sin

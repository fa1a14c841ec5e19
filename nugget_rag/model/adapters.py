"""The encoder and decoder LoRA adapters on one frozen LLaMA: the only module that touches PEFT's internals.

Both adapters live in one PEFT model and train in the same step, so switching must not go through PEFT's
`set_adapter` / `enable_adapters`, which also rewrite `requires_grad` (the inactive adapter would stop training).
Instead each LoRA layer's two switches (`_active_adapter`, `_disable_adapters`) are flipped directly. What this
relies on is pinned by `tests/test_adapters.py` for the PEFT range in pyproject.toml.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import DECODER, ENCODER, LoraSettings, MergedFormat
from .base_model import quiet_loading
from .int8 import Int8Linear


def weights_version(params) -> tuple:
    """Changes when any of these tensors is changed in place (version counter) or replaced (id, storage)."""
    return tuple((id(p), p.data_ptr(), p._version) for p in params)


class Adapters:
    """An encoder and a decoder LoRA adapter on `lm` (a LlamaForCausalLM), switched per pass.

    The encoder adapter leaves out the last layer's query and output projections: nuggets are keys/values, which
    those never shape.
    """

    def __init__(self, lm: nn.Module, settings: LoraSettings):
        common = dict(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(settings.target_modules), bias="none")
        unused = rf".*layers\.{lm.config.num_hidden_layers - 1}\.self_attn\.(q_proj|o_proj)"
        with quiet_loading():
            self.peft = get_peft_model(lm, LoraConfig(**common, exclude_modules=unused), adapter_name=ENCODER)
        self.peft.add_adapter(DECODER, LoraConfig(**common))
        self.layers = [m for m in self.peft.modules() if isinstance(m, BaseTunerLayer)]
        self._slots = {
            adapter: [(name, self.peft.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
                      for name, _ in self.peft.named_parameters() if f".{adapter}." in name and "lora_" in name]
            for adapter in (ENCODER, DECODER)
        }
        # Passes without autograd run these adapters as merged weights: one fused matrix product per adapted layer
        # instead of three (generation is then as fast per token as the base model), for the memory of one copy
        # of the adapted layers per adapter. Set to () to save that memory; add ENCODER to merge compression too.
        self.merged: tuple[str, ...] = (DECODER,)
        # "int8": those passes run every linear layer of the decoder stack as int8 (int8.py; CPU, float32 models)
        self.merged_format: MergedFormat = "float"
        # Each swappable linear layer as (parent, attribute): the LoRA layers' base layers, then the plain ones.
        tuned = {id(m) for layer in self.layers for m in layer.modules()}
        self.slots = [(layer, "base_layer") for layer in self.layers] + [
            (parent, name) for parent in lm.model.layers.modules() if id(parent) not in tuned
            for name, child in parent.named_children() if isinstance(child, nn.Linear) and id(child) not in tuned
        ]
        self._merged_cache: dict[tuple[str, str], tuple[tuple, list[nn.Module | None]]] = {}  # by adapter, format
        self._int8_head: tuple[tuple | None, Int8Linear | None] = (None, None)  # (weights it was built from, layer)
        self.original_modules: list[nn.Module] | None = None  # the slots' own layers while stand-ins are in place

    # ------------------------------------------------------------------ weights
    def named_parameters(self, adapter: str) -> list[tuple[str, nn.Parameter]]:
        """One adapter's LoRA weights by name, in the model's order (read from their modules at every call, so a
        replaced tensor is seen; without walking the whole module tree, which costs milliseconds per call)."""
        return [(name, getattr(module, leaf)) for name, module, leaf in self._slots[adapter]]

    def parameters(self, adapter: str) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters(adapter))

    def version(self, adapter: str | None) -> tuple:
        """Changes whenever one of the adapter's weights is changed in place or replaced."""
        return weights_version(self.parameters(adapter) if adapter else ())

    def state_dict(self, adapter: str) -> dict[str, torch.Tensor]:
        return get_peft_model_state_dict(self.peft, adapter_name=adapter)

    def load_state_dict(self, adapter: str, tensors: dict[str, torch.Tensor]) -> None:
        result = set_peft_model_state_dict(self.peft, tensors, adapter_name=adapter)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"unexpected {adapter} weights {result.unexpected_keys[:3]}")

    # ------------------------------------------------------------------ switching
    @contextmanager
    def use(self, adapter: str | None):
        """Run with one adapter active, or none (the frozen base model); in `merged` and without autograd, as
        merged weights (`merged_format`)."""
        merge = adapter in self.merged and not torch.is_grad_enabled()
        if merge:  # adapters off, each adapted layer swapped for its merged copy W + scale * B @ A
            switches = [(layer._active_adapter, True) for layer in self.layers]
        else:
            switches = [([adapter] if adapter else layer._active_adapter, adapter is None) for layer in self.layers]
        with self._switched(switches), self._swapped(self._merged_layers(adapter) if merge else None):
            yield

    @contextmanager
    def _swapped(self, standins: list[nn.Module | None] | None):
        """Put the stand-in layers in their slots (None: the slot keeps its own), or with standins=None the slots'
        own layers, also inside another adapter's merged pass; restore what was there afterwards."""
        outer = self.original_modules
        if standins is None and outer is None:  # nothing swapped, nothing to swap: the common case costs nothing
            yield
            return
        saved = [parent._modules[name] for parent, name in self.slots]
        originals = outer or saved
        chosen = [m if m is not None else o for m, o in zip(standins, originals)] if standins else originals
        self.original_modules = originals if standins else None
        try:
            for (parent, name), module in zip(self.slots, chosen):
                parent._modules[name] = module
            yield
        finally:
            for (parent, name), module in zip(self.slots, saved):
                parent._modules[name] = module
            self.original_modules = outer

    def _merged_layers(self, adapter: str) -> list[nn.Module | None]:
        """Each slot's stand-in in `merged_format` (float: None where the adapter is absent), rebuilt when a
        weight changed."""
        originals = self.original_modules or [parent._modules[name] for parent, name in self.slots]
        stamp = (self.version(adapter), weights_version(m.weight for m in originals))
        key = (adapter, self.merged_format)
        cached = self._merged_cache.get(key)
        if cached is None or cached[0] != stamp:
            self._merged_cache.pop(key, None)  # free the stale copy before building the new one
            with torch.no_grad():
                cached = self._merged_cache[key] = (stamp, [self._merged_layer(adapter, parent, module)
                                                                for (parent, _), module in zip(self.slots, originals)])
        return cached[1]

    def output_layer(self, head: nn.Linear) -> nn.Module:
        """The output layer `head` (never adapted), as int8 in passes without autograd under merged_format "int8"."""
        if self.merged_format != "int8" or torch.is_grad_enabled():
            return head
        stamp = weights_version([head.weight])
        if self._int8_head[0] != stamp:
            self._int8_head = (stamp, Int8Linear(head.weight, head.bias))
        return self._int8_head[1]

    def _merged_layer(self, adapter: str, parent: nn.Module, layer: nn.Linear) -> nn.Module | None:
        weight = layer.weight
        if isinstance(parent, BaseTunerLayer) and adapter in parent.lora_A:
            weight = (weight.float() + parent.get_delta_weight(adapter).float()).to(weight.dtype)
        elif self.merged_format == "float":
            return None
        if self.merged_format == "int8":
            return Int8Linear(weight, layer.bias)
        merged = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        merged.weight, merged.bias = nn.Parameter(weight, requires_grad=False), layer.bias
        return merged

    @contextmanager
    def _switched(self, switches: list[tuple[list[str], bool]]):
        """Set each LoRA layer's (active adapter, disabled) switches; restore them afterwards."""
        saved = [(layer._active_adapter, layer._disable_adapters) for layer in self.layers]
        # Plain attributes set through __dict__: nn.Module.__setattr__ costs microseconds per call, per layer.
        for layer, (active, disabled) in zip(self.layers, switches):
            vars(layer).update(_active_adapter=active, _disable_adapters=disabled)
        try:
            yield
        finally:
            for layer, (active, disabled) in zip(self.layers, saved):
                vars(layer).update(_active_adapter=active, _disable_adapters=disabled)

    # ------------------------------------------------------------------ gradient checkpointing
    def enable_gradient_checkpointing(self, llama: nn.Module) -> None:
        """Checkpoint every decoder layer of `llama`; the replay runs under the adapter that was active in the
        forward pass (nugget data travels as a forward argument, so the replay keeps the nuggets)."""
        llama.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for module in llama.modules():
            if getattr(module, "gradient_checkpointing", False):
                module._gradient_checkpointing_func = self._checkpoint_with_adapter

    def _checkpoint_with_adapter(self, function, *args):
        switches = [(layer._active_adapter, layer._disable_adapters) for layer in self.layers]

        def replay(*inputs):
            with self._switched(switches):
                return function(*inputs)

        return checkpoint(replay, *args, use_reentrant=False)

"""What a NuggetState and a checkpoint are bound to: digests of the base model, its tokenizer and the trained weights.

A state's fingerprint starts with its base model's digest (`state_tag`) and hashes everything that shaped it; the
decoder reads only states of its own base model, and a checkpoint loads only onto the base model it was trained on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..config import ENCODER, MergedFormat, NuggetConfig
from ..state.nugget_state import NuggetState
from .adapters import Adapters, weights_version
from .scorer import Scorer


def base_digest(model: nn.Module) -> str:
    """A dtype-independent digest of the frozen base weights (a strided sample of every tensor)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 4096)][:4096].to(torch.bfloat16).float().cpu()
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]


def tokenizer_digest(tokenizer) -> str:
    """sha256 of what decides a tokenizer's ids, not where it was loaded from: its vocabulary, merges and normalising
    rules (a fast tokenizer's serialisation, without its per-call truncation and padding), special tokens and chat
    template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        core = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    else:  # a slow tokenizer
        core = sorted(tokenizer.get_vocab().items())
    meta = [core, tokenizer.all_special_tokens, tokenizer.chat_template, len(tokenizer)]
    return hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode()).hexdigest()[:32]


def weights_digest(named: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 of named weights' values (in float32)."""
    h = hashlib.sha256()
    for name, p in named:
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


class Identity:
    """NuggetModel's identity hashing, as a mixin: NuggetModel sets the attributes below."""

    base_name: str
    config: NuggetConfig
    adapters: Adapters
    scorer: Scorer
    document_opening: list[int]
    dtype: torch.dtype
    device: torch.device
    merged_adapters: tuple[str, ...]
    merged_format: MergedFormat
    segment_length: Callable[[int | None], int]
    _base_digest: str  # base_digest() of the LLaMA
    _weights_digests: dict[str | None, tuple[tuple, str]]  # adapter -> (what it hashed, its sha256)

    def fingerprint(self, ratio: float | None = None, adapter: str | None = ENCODER,
                    segment_tokens: int | None = None, ranked: bool = False) -> str:
        """Digest of everything that shapes a NuggetState: base model, the compressing adapter (weights and LoRA
        settings), Scorer, r (a ranked state's floor), segment length, dtype."""
        ratio = self.config.ratio if ratio is None else ratio
        segment_tokens = self.segment_length(segment_tokens)
        named = self.adapters.named_parameters(adapter) if adapter else []
        named += [(f"scorer.{n}", p) for n, p in self.scorer.named_parameters()]
        # Hashing every weight costs a device-to-host copy; redo it only when a weight changed in place
        # (an optimiser step, a load) or was replaced, which version counters, ids and storage pointers tell.
        stamp = (adapter, weights_version(p for _, p in named))
        cached = self._weights_digests.get(adapter)  # one read: another thread may replace it meanwhile
        if cached is None or cached[0] != stamp:
            cached = self._weights_digests[adapter] = (stamp, weights_digest(named))
        identity = [self._base_digest, ratio, self.config.scorer_layer, str(self.dtype), adapter, segment_tokens,
                    self.config.lora.model_dump(mode="json") if adapter else None, cached[1]]
        identity += [self.document_opening] if self.document_opening else []
        identity += ["int8"] if adapter in self.merged_adapters and self.merged_format == "int8" else []
        identity += ["ranked"] if ranked else []
        return self.state_tag(hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32])

    @property
    def base_digest(self) -> str:
        """Digest of the base model's weights (what a checkpoint and a NuggetState are bound to)."""
        return self._base_digest

    def state_tag(self, name: str) -> str:
        """A NuggetState fingerprint naming this base model, then `name`; the decoder reads only states whose
        fingerprint names its own base model."""
        return f"{self._base_digest[:12]}:{name}"

    def check_origin(self, states: Iterable[NuggetState]) -> None:
        """Refuse states made by another base model than this one."""
        origin = self.state_tag("")
        for state in states:
            if not state.fingerprint.startswith(origin):
                raise ValueError(f"a NuggetState with fingerprint {state.fingerprint!r} was made by another base model "
                                 f"than {self.base_name!r} (fingerprints start {origin!r}); compress the document "
                                 "with this model")

    def weights_stamp(self, adapter: str | None) -> tuple:
        """Changes whenever an adapter weight is changed in place or replaced (as in `fingerprint`)."""
        return (adapter, str(self.dtype), str(self.device), self.adapters.version(adapter),
                self.merged_format if adapter in self.merged_adapters else None)

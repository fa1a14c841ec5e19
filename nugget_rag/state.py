"""NuggetState: one compressed document, and its safetensors serialisation."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

FORMAT = "nugget-rag/state-v1"


class CorruptStateError(ValueError):
    """Stored bytes that are not a complete, untampered NuggetState."""


@dataclass
class NuggetState:
    """A document's nuggets: every layer's key/value states at the selected token positions.

    keys, values: [layers, kv_heads, k, head_dim]; the keys carry the rotary phase of `positions`.
    positions: [k] ascending token indices into the document; tokens: their token strings.
    scores: [k] the Scorer's scores at those positions (they carry the gradient while training).
    n: the document's length in tokens; fingerprint: what produced the state ("<base model digest>:<digest of
    adapter, Scorer, r, ...>", `NuggetModel.fingerprint`); a decoder reads only states of its own base model.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    tokens: list[str]
    n: int
    fingerprint: str

    @property
    def k(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions, self.scores))

    def detach(self) -> NuggetState:
        return NuggetState(
            self.keys.detach(), self.values.detach(), self.positions, self.scores.detach(),
            self.tokens, self.n, self.fingerprint,
        )

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> NuggetState:
        return NuggetState(
            self.keys.to(device, dtype), self.values.to(device, dtype), self.positions.to(device),
            self.scores.to(device), self.tokens, self.n, self.fingerprint,
        )

    def to_bytes(self) -> bytes:
        """Safetensors bytes; the metadata names the fingerprint and a digest of the tensor data."""
        tensors = {
            "keys": self.keys.detach().contiguous().cpu(),
            "values": self.values.detach().contiguous().cpu(),
            "positions": self.positions.detach().contiguous().cpu(),
            "scores": self.scores.detach().float().contiguous().cpu(),
        }
        meta = {"format": FORMAT, "n": str(self.n), "fingerprint": self.fingerprint, "tokens": json.dumps(self.tokens)}
        meta["digest"] = _digest(tensors, meta)
        return save_tensors(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> NuggetState:
        """Parse and verify; raises CorruptStateError on truncated, altered or foreign bytes."""
        try:
            meta = _read_metadata(data)
            tensors = load_tensors(data)
            if meta.get("format") != FORMAT:
                raise CorruptStateError(f"format {meta.get('format')!r} is not {FORMAT!r}")
            if meta.get("digest") != _digest(tensors, meta):
                raise CorruptStateError("content does not match its digest")
            tokens = json.loads(meta["tokens"])
            state = cls(tensors["keys"], tensors["values"], tensors["positions"], tensors["scores"],
                        tokens, int(meta["n"]), meta["fingerprint"])
            _check_shapes(state)
        except CorruptStateError:
            raise
        except (SafetensorError, ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError) as err:
            raise CorruptStateError(f"not a readable nugget state ({err})") from err
        return state


def _check_shapes(state: NuggetState) -> None:
    if state.positions.ndim != 1:
        raise CorruptStateError("positions are not one index per nugget")
    k = state.k
    if not (isinstance(state.tokens, list) and len(state.tokens) == k and all(isinstance(t, str) for t in state.tokens)):
        raise CorruptStateError("the token list does not match the nugget count")
    if state.keys.ndim != 4 or state.keys.shape != state.values.shape or state.keys.shape[2] != k:
        raise CorruptStateError(f"keys {tuple(state.keys.shape)} and values {tuple(state.values.shape)} are not "
                                f"[layers, kv_heads, {k}, head_dim]")
    if state.scores.shape != (k,):
        raise CorruptStateError("scores are not one value per nugget")


def _digest(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "digest"}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _read_metadata(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise ValueError("too short")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError("truncated header")
    header = json.loads(data[8 : 8 + size])
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("the header is not a safetensors header")
    return meta

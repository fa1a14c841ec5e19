"""NuggetState: one compressed document, and its safetensors serialisation."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..config import nugget_count

UNIDENTIFIED = "unidentified"  # the fingerprint name of states from a training pass (compress(identify=False))

FORMAT = "nugget-rag/state-v3"
# v1: float32 keys and values, no kv_format; v2: no floor (every state in reading order)
READABLE_FORMATS = ("nugget-rag/state-v1", "nugget-rag/state-v2", FORMAT)
KVFormat = Literal["float32", "bfloat16", "float16", "int8", "int4"]
KV_FORMATS: tuple[str, ...] = get_args(KVFormat)
_FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INT_BITS = {"int8": 8, "int4": 4}


class CorruptStateError(ValueError):
    """Stored bytes that are not a complete, untampered NuggetState."""


@dataclass
class NuggetState:
    """A document's nuggets: every layer's key/value states at the selected token positions.

    keys, values: [layers, kv_heads, k, head_dim]; the keys carry the rotary phase of `positions`.
    positions: [k] token indices into the document; tokens: their token strings. In reading order (what the
    decoder reads) they ascend; a ranked state (`floor` set) keeps them in resolution order instead, segment by
    segment (`segments`: the lengths of the segments compressed apart), so that reading it at any ratio r >= floor
    takes a prefix of each segment (`at_ratio`).
    scores: [k] the Scorer's scores at those positions (they carry the gradient while training).
    n: the document's length in tokens; fingerprint: what produced the state ("<base model digest>:<digest of
    adapter, Scorer, r, ...>", `NuggetModel.fingerprint`); a decoder reads only states of its own base model.
    kv_format: how keys and values are stored (`compact`): None (as the tensors are), a float dtype, or int8 / int4
    (keys quantised per channel, values per token, as KIVI does; int4 packs two codes a byte; held dequantised in
    float32 in memory).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    tokens: list[str]
    n: int
    fingerprint: str
    kv_format: str | None = None
    floor: float | None = None
    segments: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.floor is not None and self.segments is None:
            self.segments = (self.n,)

    @property
    def ranked(self) -> bool:
        """Whether the state holds its nuggets in resolution order, readable at any ratio >= floor."""
        return self.floor is not None

    @property
    def k(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions, self.scores))

    def count_at(self, ratio: float) -> int:
        """Nuggets read at `ratio` (ceil(n_s / r) per segment); a ValueError below the floor."""
        self._check_readable(ratio)
        return sum(nugget_count(length, ratio) for length in self.segments)

    def at_ratio(self, ratio: float) -> NuggetState:
        """The state read at ratio r >= floor, in reading order: the same positions, keys and values as the document
        compressed at r (floating-point formats; int8/int4 keys share scales over the stored nuggets)."""
        index = self._prefix(ratio)
        return self._take(index[self.positions[index].argsort()], floor=None, segments=None)

    def with_floor(self, floor: float) -> NuggetState:
        """The ranked state cut to a coarser floor: what a store with keep_ratio = floor holds of the document."""
        return self._take(self._prefix(floor), floor=floor, segments=self.segments)

    def _prefix(self, ratio: float) -> torch.Tensor:
        """Indices of the nuggets of `ratio`: each segment's first ceil(n_s / r) entries."""
        self._check_readable(ratio)
        parts, start = [], 0
        for length in self.segments:
            parts.append(torch.arange(start, start + nugget_count(length, ratio), device=self.positions.device))
            start += nugget_count(length, self.floor)
        return torch.cat(parts)

    def _take(self, index: torch.Tensor, **fields) -> NuggetState:
        return replace(self, keys=self.keys[:, :, index], values=self.values[:, :, index],
                       positions=self.positions[index], scores=self.scores[index],
                       tokens=[self.tokens[i] for i in index.tolist()], **fields)

    def _check_readable(self, ratio: float) -> None:
        if self.floor is None:
            raise ValueError("this state is in reading order, made at one ratio; only a ranked state (floor set) "
                             "can be read at another")
        if ratio < self.floor:
            raise ValueError(f"ratio {ratio} is finer than this state's floor {self.floor}: it keeps only the "
                             f"nuggets of ratios >= {self.floor}; compress the document again at {ratio}")

    def detach(self) -> NuggetState:
        return replace(self, keys=self.keys.detach(), values=self.values.detach(), scores=self.scores.detach())

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> NuggetState:
        """On `device`, keys and values cast to `dtype` (the decoder's; kv_format says how they were stored)."""
        return replace(self, keys=self.keys.to(device, dtype), values=self.values.to(device, dtype),
                       positions=self.positions.to(device), scores=self.scores.to(device))

    def compact(self, kv_format: str) -> NuggetState:
        """This state as it is stored and read back in `kv_format`: float formats are a cast; int8 quantises keys
        per channel and values per token (absmax scales) and dequantises them, so that a state used right away and
        one read from the store are the same."""
        if kv_format not in KV_FORMATS:
            raise ValueError(f"unknown kv_format {kv_format!r}; use one of {', '.join(KV_FORMATS)}")
        keys, values = self.keys.detach(), self.values.detach()
        if kv_format in _INT_BITS:
            bits = _INT_BITS[kv_format]
            keys, values = _dequantize(*_quantize(keys, 2, bits)), _dequantize(*_quantize(values, 3, bits))
        else:
            keys, values = keys.to(_FLOAT_FORMATS[kv_format]), values.to(_FLOAT_FORMATS[kv_format])
        return replace(self, keys=keys, values=values, scores=self.scores.detach(), kv_format=kv_format)

    def to_bytes(self) -> bytes:
        """Safetensors bytes in the state's kv_format; the metadata names the fingerprint and a digest of the data."""
        tensors = {
            "positions": self.positions.detach().contiguous().cpu(),
            "scores": self.scores.detach().float().contiguous().cpu(),
        }
        keys, values = self.keys.detach().cpu(), self.values.detach().cpu()
        if self.kv_format in _INT_BITS:
            bits = _INT_BITS[self.kv_format]
            (tensors["keys"], tensors["key_scales"]), (tensors["values"], tensors["value_scales"]) = (
                _quantize(keys, 2, bits), _quantize(values, 3, bits))
            if bits == 4:
                tensors["keys"], tensors["values"] = _pack4(tensors["keys"]), _pack4(tensors["values"])
        else:
            tensors["keys"], tensors["values"] = keys, values
        tensors = {name: t.contiguous() for name, t in tensors.items()}
        kv_format = self.kv_format if self.kv_format in _INT_BITS else str(keys.dtype).removeprefix("torch.")
        meta = {"format": FORMAT, "kv_format": kv_format, "n": str(self.n), "fingerprint": self.fingerprint,
                "tokens": json.dumps(self.tokens)}
        if self.ranked:
            meta |= {"floor": repr(float(self.floor)), "segments": json.dumps(list(self.segments))}
        meta["digest"] = _digest(tensors, meta)
        return save_tensors(tensors, metadata=meta)

    @staticmethod
    def stored_fingerprint(data: bytes) -> str:
        """The fingerprint a state's bytes name, read from their header alone (not verified: `from_bytes` does);
        raises CorruptStateError when the bytes have no readable header."""
        try:
            fingerprint = _read_metadata(data)["fingerprint"]
        except (ValueError, KeyError, UnicodeDecodeError) as err:
            raise CorruptStateError(f"not a readable nugget state ({err!r})") from err
        if not isinstance(fingerprint, str):
            raise CorruptStateError(f"not a readable nugget state (fingerprint {fingerprint!r})")
        return fingerprint

    @classmethod
    def from_bytes(cls, data: bytes) -> NuggetState:
        """Parse and verify; raises CorruptStateError on truncated, altered or foreign bytes."""
        try:
            meta = _read_metadata(data)
            tensors = load_tensors(data)
            if meta.get("format") not in READABLE_FORMATS:
                raise CorruptStateError(f"format {meta.get('format')!r} is none of {', '.join(READABLE_FORMATS)}")
            if meta.get("digest") != _digest(tensors, meta):
                raise CorruptStateError("content does not match its digest")
            kv_format = meta.get("kv_format", "float32")
            if kv_format not in KV_FORMATS:
                raise CorruptStateError(f"unknown kv_format {kv_format!r}")
            keys, values = tensors["keys"], tensors["values"]
            if kv_format == "int4":
                keys, values = _unpack4(keys), _unpack4(values)
            if kv_format in _INT_BITS:
                keys, values = _dequantize(keys, tensors["key_scales"]), _dequantize(values, tensors["value_scales"])
            tokens = json.loads(meta["tokens"])
            floor = float(meta["floor"]) if "floor" in meta else None
            segments = tuple(int(s) for s in json.loads(meta["segments"])) if floor is not None else None
            state = cls(keys, values, tensors["positions"], tensors["scores"], tokens, int(meta["n"]),
                        meta["fingerprint"], kv_format, floor, segments)
            _check_shapes(state)
        except CorruptStateError:
            raise
        except (SafetensorError, ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError) as err:
            raise CorruptStateError(f"not a readable nugget state ({err})") from err
        return state


def _quantize(x: torch.Tensor, dim: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed codes of `bits` bits (as int8) of `x` and float32 absmax scales, one per slice along `dim`."""
    x, top = x.float(), 2 ** (bits - 1) - 1
    scale = (x.abs().amax(dim=dim, keepdim=True) / top).clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scale).round().clamp(-top, top).to(torch.int8), scale


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (-7..7) two a byte along the last dimension (even: a rotary head's)."""
    shifted = (codes + 8).to(torch.uint8)
    return shifted[..., 0::2] | (shifted[..., 1::2] << 4)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    low, high = (packed & 15).to(torch.int8) - 8, (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).flatten(-2)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale


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
    if state.ranked:
        if not (state.floor >= 1 and sum(state.segments) == state.n and all(s >= 1 for s in state.segments)):
            raise CorruptStateError(f"floor {state.floor} or segments {state.segments} do not fit n = {state.n}")
        if sum(nugget_count(s, state.floor) for s in state.segments) != k:
            raise CorruptStateError(f"{k} nuggets are not those of floor {state.floor} over segments {state.segments}")


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

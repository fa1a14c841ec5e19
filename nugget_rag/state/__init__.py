"""A document's nuggets once compressed: the NuggetState (per-layer keys/values at the kept positions) and the
NuggetStore that caches states by document and model, in memory, a directory or Redis."""

from .nugget_state import KV_FORMATS, CorruptStateError, NuggetState

__all__ = ["KV_FORMATS", "CorruptStateError", "NuggetState"]

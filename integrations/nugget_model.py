"""The nugget model as the LangChain document compressor an index fills its store with."""

from __future__ import annotations

from pathlib import Path

from nugget_rag.components.compressor import NuggetCompressor
from nugget_rag.model.checkpoint_files import DEFAULT_CHECKPOINT
from nugget_rag.state.store import NuggetStore


def load_compressor(
    checkpoint: str | Path | None = DEFAULT_CHECKPOINT,
    base_model: str | Path | None = None,
    store_dir: str | Path | None = None,
    device: str | None = None,
    ratio: float | None = None,
    store: NuggetStore | None = None,
    dtype: str | None = None,
) -> NuggetCompressor:
    """`NuggetCompressor.from_pretrained`: the shipped checkpoint by default; None: untrained (seeded, so its
    fingerprint is stable). The nuggets go to `store`, else a directory store in `store_dir`, else memory."""
    shared = {"store": store} if store is not None else {}
    return NuggetCompressor.from_pretrained(checkpoint, base_model=base_model, store_dir=store_dir, device=device,
                                            dtype=dtype, ratio=ratio, **shared)


__all__: list[str] = ["load_compressor"]

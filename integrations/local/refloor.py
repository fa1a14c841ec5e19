"""Re-floor a saved index: cut each chunk's stored state to a coarser floor, keeping only what readings at or above
it need (`NuggetState.with_floor`: the same nuggets, in the same order, as compressing at that floor).

The new states are written first, then the manifest names the new floor (the commit), then the old states are
deleted: a crash leaves the index at its old floor or its new one, whole. A reading finer than the new floor asked
for later is compressed and stored on demand, as for any index.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore
from pydantic import BaseModel
from tqdm.auto import tqdm

from nugget_rag.components.compressor import NuggetCompressor
from nugget_rag.config import NuggetConfig

from .index import NuggetIndex


class RefloorReport(BaseModel):
    """What a re-floor did: states cut (and missing: never stored or evicted, computed when read) and their bytes."""

    old_floor: float
    new_floor: float
    chunks: int
    refloored: int
    missing: int
    bytes_before: int
    bytes_after: int


def refloor(directory: str | Path, compressor: NuggetCompressor, keep_ratio: float,
            embeddings: Embeddings | None = None, show_progress: bool = False,
            vectorstore: VectorStore | None = None) -> RefloorReport:
    """Cut the stored states of the index in `directory` to the floor `keep_ratio` (coarser than its own);
    `vectorstore`: the user's store the index keeps its vectors in (None: its own FAISS)."""
    new_floor = NuggetConfig(ratio=keep_ratio).ratio
    with NuggetIndex.updating(directory, compressor, embeddings, vectorstore=vectorstore) as index:  # the lock is held until the save
        old = index.compressor
        if new_floor < old.keep_ratio:
            raise ValueError(f"the index in {directory} keeps nuggets down to r = {old.keep_ratio:g}; a floor of "
                             f"{new_floor:g} needs the nuggets it no longer has: ingest into a new index directory "
                             f"with keep_ratio={new_floor:g}")
        new = old.model_copy(update={"keep_ratio": new_floor})
        texts = list(dict.fromkeys(d.page_content for d in index.documents))
        report = RefloorReport(old_floor=old.keep_ratio, new_floor=new_floor, chunks=len(texts), refloored=0,
                               missing=0, bytes_before=0, bytes_after=0)
        if new_floor == old.keep_ratio:
            return report
        store, stale = old.store, []
        for text in tqdm(texts, desc="re-flooring", unit="chunk", disable=not show_progress):
            state = store.get(text, old.fingerprint)
            if state is None:
                report.missing += 1
                continue
            cut = dataclasses.replace(state.with_floor(new_floor), fingerprint=new.fingerprint)
            report.bytes_before += len(state.to_bytes())
            report.bytes_after += len(cut.to_bytes())
            store.put(text, cut)
            stale.append(store.key(text, old.fingerprint))
            report.refloored += 1
        index.compressor = new  # the save below writes the new floor into the manifest
    store.delete(stale)
    return report

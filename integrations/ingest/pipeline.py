"""The one ingest pipeline that every entrance runs (NuggetIndex.ingest, the server's /ingest and its jobs, Ray's
ingest_distributed and its serve replicas):

    split -> de-duplicate -> compress -> embed -> add

`split` cuts documents into chunks with the index's token splitter (deterministic ids); `unindexed` drops the chunks
already in the index and repeats within the batch; `compress` puts each new chunk's nuggets into the compressor's
store (a state already there is read, never recomputed); `embed` makes their vectors; `add` puts them into the
vector store and the index's records. Compress and embed run in a CompressStage: here, a batch at a time
(`InProcess`), or on a Ray cluster's workers (ray.RayCompression), which call the same `compress` and
`embed`. Each batch is compressed before it is added, so every indexed chunk has its nuggets in the store; a
cancelled ingest (cancellation.py) stops at its next batch, every batch added so far whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import nullcontext
from typing import Any, Protocol

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from tqdm.auto import tqdm

from nugget_rag.cancellation import Stop, cancellable, check
from nugget_rag.components.compressor import METADATA_KEY, NuggetCompressor

log = logging.getLogger(__name__)

Vectors = list[list[float]]


class IngestTarget(Protocol):
    """What the pipeline reads and changes of an index (NuggetIndex)."""

    compressor: NuggetCompressor
    embeddings: Embeddings
    batch_size: int
    show_progress: bool
    last_ingest: dict[str, Any]

    @property
    def ids(self) -> list[str]: ...

    def split(self, documents: Sequence[Document]) -> list[Document]: ...

    def add_chunks(self, docs: Sequence[Document], vectors: Sequence[Sequence[float]]) -> None: ...


class CompressStage(Protocol):
    """Compresses new chunks into the index's store and embeds them: (compressed chunks, their vectors) batches, in
    the chunks' order; `stats` adds to the ingest's `last_ingest`."""

    stats: dict[str, Any]

    def __call__(self, index: IngestTarget, chunks: list[Document]) -> Iterator[tuple[list[Document], Vectors]]: ...


# ---------------------------------------------------------------------------------------------- the stages
def split(index: IngestTarget, documents: Sequence[Document]) -> list[Document]:
    """The index's chunks of `documents`, each with its deterministic id (NuggetIndex.split)."""
    return index.split(documents)


def unindexed(chunks: Iterable[Document], indexed: Collection[str]) -> list[Document]:
    """The chunks to add: those whose id is not in `indexed`, each id once (a text twice in a batch is added once)."""
    new: dict[str, Document] = {}
    for chunk in chunks:
        if chunk.id not in indexed and chunk.id not in new:
            new[chunk.id] = chunk
    return list(new.values())


def compress(compressor: NuggetCompressor, chunks: Sequence[Document]) -> list[Document]:
    """The chunks with their nuggets' metadata; their states are in the compressor's store (computed only where
    missing)."""
    return compressor.invoke(list(chunks))


def embed(embeddings: Embeddings, chunks: Sequence[Document]) -> Vectors:
    """The retrieval vectors of the chunks' texts."""
    return embeddings.embed_documents([chunk.page_content for chunk in chunks]) if chunks else []


def add(index: IngestTarget, chunks: Sequence[Document], vectors: Vectors) -> None:
    """Put compressed chunks and their vectors into the index's vector store and records."""
    index.add_chunks(chunks, vectors)


class InProcess:
    """The compress stage in this process: `index.batch_size` chunks at a time, with a progress bar
    (`index.show_progress`) of chunks and tokens/s."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def __call__(self, index: IngestTarget, chunks: list[Document]) -> Iterator[tuple[list[Document], Vectors]]:
        bar = tqdm(total=len(chunks), desc="ingesting", unit="chunk", disable=not index.show_progress or not chunks)
        tokens, started = 0, time.perf_counter()
        try:
            for start in range(0, len(chunks), index.batch_size):
                check()  # a cancelled ingest stops here: every batch added so far is whole
                compressed = compress(index.compressor, chunks[start : start + index.batch_size])
                yield compressed, embed(index.embeddings, compressed)
                tokens += sum(chunk.metadata[METADATA_KEY]["n_tokens"] for chunk in compressed)
                bar.update(len(compressed))
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - started):.0f} tokens/s", refresh=False)
        finally:
            bar.close()


# ---------------------------------------------------------------------------------------------- the pipeline
def ingest(index: IngestTarget, documents: Iterable[Document], stop: Stop | None = None,
           stage: CompressStage | None = None) -> int:
    """Split `documents`, de-duplicate, compress into the store, embed and add to `index`; returns the new chunks.

    Chunks already indexed are skipped (ingesting a text again adds nothing, computes nothing). `stop`: once it is
    true, the ingest raises RequestCancelled at its next batch (the batches added so far stay). `stage`: where
    compress and embed run (default InProcess). `index.last_ingest` tells what was done.
    """
    with cancellable(stop) if stop is not None else nullcontext():
        started = time.perf_counter()
        documents = list(documents)
        chunks = split(index, documents)
        todo = unindexed(chunks, set(index.ids))
        stage = stage if stage is not None else InProcess()
        tokens = 0
        for compressed, vectors in stage(index, todo):
            add(index, compressed, vectors)
            tokens += sum(chunk.metadata[METADATA_KEY]["n_tokens"] for chunk in compressed)
    index.last_ingest = {"documents": len(documents), "chunks": len(chunks), "added": len(todo),
                         "skipped": len(chunks) - len(todo), "tokens": tokens,
                         "seconds": round(time.perf_counter() - started, 3), **stage.stats}
    log.info("ingested %(documents)d documents: %(chunks)d chunks, %(added)d new, %(skipped)d already indexed",
             index.last_ingest)
    return len(todo)


__all__ = ["CompressStage", "InProcess", "IngestTarget", "add", "compress", "embed", "ingest", "split", "unindexed"]

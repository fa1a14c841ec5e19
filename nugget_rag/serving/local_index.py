"""The index one server process keeps, served (ServedIndex): in memory, or saved in a directory that `nugget-rag
ingest` and other servers update too. Either way questions read a published version that no ingest changes."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

from langchain_core.documents import Document

from ..cancellation import Stop
from ..integrations.ingest import pipeline as ingest_pipeline
from ..integrations.local.index import NuggetIndex, ingest_into_directory
from .served_index import ServedIndex


class MemoryIndex:
    """`index` kept in memory: ingests add to it one at a time, each published as a copy for questions to read.
    Each ingest runs the pipeline (split, compress, embed) outside the turn and stoppable, against the version
    published when it started; in its turn it adds the chunks still missing. A stopped ingest leaves the index as
    it was."""

    def __init__(self, index: NuggetIndex):
        self.index, self.compressor, self.location = index, index.compressor, None
        self._turn = threading.Lock()  # held to add to `index` and publish it
        self._current = index.copy()

    def current(self) -> NuggetIndex:
        return self._current

    def ingest(self, documents: list[Document], stop: Stop) -> int:
        staged = _Staged(self._current)
        ingest_pipeline.ingest(staged, documents, stop)
        with self._turn:
            known, added = set(self.index.ids), 0
            for chunks, vectors in staged.batches:  # less any another ingest added meanwhile
                new = [i for i, chunk in enumerate(chunks) if chunk.id not in known]
                self.index.add_chunks([chunks[i] for i in new], [vectors[i] for i in new])
                known.update(chunks[i].id for i in new)
                added += len(new)
            self.index.last_ingest = {**staged.last_ingest, "added": added,
                                      "skipped": staged.last_ingest["chunks"] - added}
            self._current = self.index.copy()
        return added

    def __len__(self) -> int:
        return len(self._current)


class _Staged:
    """The ingest pipeline's target for a MemoryIndex: `version`'s settings and ids; the compressed chunks and
    their vectors are held in `batches`, for the index to add in its turn."""

    def __init__(self, version: NuggetIndex):
        self.version, self.compressor, self.embeddings = version, version.compressor, version.embeddings
        self.batch_size, self.show_progress = version.batch_size, version.show_progress
        self.last_ingest: dict[str, Any] = {}
        self.batches: list[tuple[list[Document], ingest_pipeline.Vectors]] = []

    @property
    def ids(self) -> list[str]:
        return self.version.ids

    def split(self, documents: list[Document]) -> list[Document]:
        return self.version.split(documents)

    def add_chunks(self, docs: list[Document], vectors: ingest_pipeline.Vectors) -> None:
        self.batches.append((list(docs), list(vectors)))


class DirectoryIndex:
    """`index`, saved in `directory`: each ingest updates a copy read from what is saved there, under the
    directory's lock (so another process's updates stay), and publishes it once saved, never over the copy of an
    ingest that took the lock after it. With the user's own vector store, which the copies share, new chunks are
    searchable as each batch lands."""

    def __init__(self, index: NuggetIndex, directory: str | Path):
        self.directory, self.compressor, self.embeddings = Path(directory), index.compressor, index.embeddings
        self.location = str(self.directory.resolve())
        self.settings = {"chunk_tokens": index.chunk_tokens, "chunk_overlap": index.chunk_overlap,
                         "batch_size": index.batch_size, "vectorstore": index.user_vectorstore}
        self._current = index
        self._publishing = threading.Lock()
        self._versions, self._published = itertools.count(1), 0  # in the directory lock's order

    def current(self) -> NuggetIndex:
        return self._current

    def ingest(self, documents: list[Document], stop: Stop) -> int:
        drawn: list[int] = []  # the update's version, drawn under the directory's lock: in the order of the saves

        def numbered(index: NuggetIndex, documents: list[Document]) -> int:
            added = index.ingest(documents)
            drawn.append(next(self._versions))
            return added

        updated, added = ingest_into_directory(self.directory, self.compressor, self.embeddings, documents, stop,
                                               numbered, **self.settings)  # stopped, the copy is not saved
        with self._publishing:
            if drawn[0] > self._published:
                self._current, self._published = updated, drawn[0]
        return added

    def __len__(self) -> int:
        return len(self._current)


def local_index(index: NuggetIndex, directory: str | Path | None = None) -> ServedIndex:
    """`index` served from this process: saved in `directory` after each ingest, or kept in memory (None)."""
    return MemoryIndex(index) if directory is None else DirectoryIndex(index, directory)


__all__ = ["DirectoryIndex", "MemoryIndex", "local_index"]

"""The index one server process keeps, served (ServedIndex): in memory, or saved in a directory that `nugget-rag
ingest` and other servers update too. Either way questions read a published version that no ingest changes."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from langchain_core.documents import Document

from ..cancellation import Stop, cancellable
from ..integrations.index import NuggetIndex
from .served_index import ServedIndex


class MemoryIndex:
    """`index` kept in memory: ingests add to it one at a time, each published as a copy for questions to read.
    The states are compressed first, outside the turn and stoppable: a stopped ingest leaves the index as it was."""

    def __init__(self, index: NuggetIndex):
        self.index, self.compressor, self.location = index, index.compressor, None
        self._turn = threading.Lock()  # held to add to `index` and publish it
        self._current = index.copy()

    def current(self) -> NuggetIndex:
        return self._current

    def ingest(self, documents: list[Document], stop: Stop) -> int:
        with cancellable(stop):
            self.compressor.invoke(self.index.split(documents))  # into the store, where index.ingest finds them
        with self._turn:
            added = self.index.ingest(documents)
            self._current = self.index.copy()
        return added

    def __len__(self) -> int:
        return len(self._current)


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
        with NuggetIndex.updating(self.directory, self.compressor, self.embeddings, **self.settings) as updated:
            with cancellable(stop):  # stopped, the copy is not saved
                added = updated.ingest(documents)
            version = next(self._versions)
        with self._publishing:
            if version > self._published:
                self._current, self._published = updated, version
        return added

    def __len__(self) -> int:
        return len(self._current)


def local_index(index: NuggetIndex, directory: str | Path | None = None) -> ServedIndex:
    """`index` served from this process: saved in `directory` after each ingest, or kept in memory (None)."""
    return MemoryIndex(index) if directory is None else DirectoryIndex(index, directory)


__all__ = ["DirectoryIndex", "MemoryIndex", "local_index"]

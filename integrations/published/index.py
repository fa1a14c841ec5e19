"""The index published in the nugget store, served: every process that reaches the store (a server, a Ray replica,
`nugget-rag ask` on any node) reads the same versions, with nothing but the store's URL and the model.

    index = PublishedIndex(NuggetCompressor(model=model, store=NuggetStore.from_redis(url)), embeddings)
    index.ingest(documents)            # a new version, in the store
    index.current().as_retriever()     # the newest version, whole

Only the index's own FAISS is published (with its chunks and manifest): a user's own vector store is shared by
itself. The local `cache_dir`, when given, keeps the segments read last, so that a restart reads only new ones.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings

from nugget_rag.cancellation import Stop, cancellable
from nugget_rag.components.compressor import NuggetCompressor
from nugget_rag.state.store import NuggetStore, StoreLocation

from ..local.files import IndexFileError
from ..local.index import NuggetIndex, Pipeline
from ..local.own_faiss import faiss_of, faiss_vectors
from ..local.retriever import NuggetRetriever
from ..local.settings import built_settings
from ..stores.spec import DEFAULT_VECTORSTORE
from .lock import publish_lock
from .publishing import PublishOptions, merge_groups, publish_version
from .segments import (
    Pointer,
    Segment,
    SegmentCache,
    SegmentRef,
    VersionRecord,
    VersionRemovedError,
    check_name,
    describe,
    read_pointer,
    read_record,
    read_version,
)

log = logging.getLogger(__name__)


def published_manifest(store: NuggetStore, name: str = "default") -> dict[str, Any] | None:
    """The manifest of the current version of the index `name` published in `store` (its nugget model, ratio,
    embeddings, chunking, count), read without its segments; None when none is published."""
    found = read_pointer(store, check_name(name))
    return None if found is None else read_record(store, name, found[1].version, found[1].sha256).manifest


def cache_directory(location: StoreLocation, name: str = "default") -> Path:
    """Where this machine caches the segments of the index `name` published at `location`: a folder of its own
    under $XDG_CACHE_HOME (default ~/.cache)/nugget-rag/published/."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(f"{location.redis_url}\0{location.directory}\0{location.namespace}".encode()).hexdigest()
    return base / "nugget-rag" / "published" / f"{check_name(name)}-{digest[:16]}"


def ingest_chunks(index: NuggetIndex, documents: list[Document]) -> int:
    """The default ingest pipeline: split, compress, embed and add `documents` to `index`; the new chunks."""
    return index.ingest(documents)


@dataclass(frozen=True)
class _Held:
    """A version as loaded: its pointer's bytes (None: nothing is published) and value, its record and index."""

    raw: bytes | None
    pointer: Pointer | None
    record: VersionRecord | None
    index: NuggetIndex

    @property
    def version(self) -> int:
        return 0 if self.pointer is None else self.pointer.version


class PublishedIndex:
    """The served index (ServedIndex) published in its compressor's store under `options.name`.

    `current()` reads the store's pointer (one small value) and, when it moved, loads the new version whole, then
    swaps it in: a question reads one version throughout, never a mix. `ingest` runs `pipeline` (NuggetIndex.ingest:
    split, compress, embed, add) on a copy of the current version, outside any lock, then publishes the new chunks
    as a new version, taking turns with other publishers. `settings` are NuggetIndex's keyword arguments (chunking,
    batch_size, show_progress); a published version's chunking and embeddings must be those given, if given.
    """

    def __init__(self, compressor: NuggetCompressor, embeddings: Embeddings | None = None,
                 options: PublishOptions | None = None, cache_dir: str | Path | None = None,
                 pipeline: Pipeline | None = None, **settings: Any):
        store = compressor.store
        if store.byte_store is None:
            raise ValueError("the compressor's nugget store keeps its states in memory only: an index published "
                             "there is seen by no other process; give it a Redis store (NuggetStore.from_redis) or a "
                             "directory")
        if store.location is not None and store.location.ttl is not None:
            raise ValueError(f"the nugget store {store.location} expires its keys after {store.location.ttl} s: an "
                             "index published there would vanish; publish into a store without ttl")
        if settings.get("vectorstore") is not None:
            raise ValueError("the published index is the index's own FAISS; a user's vector store is shared by "
                             "itself: use NuggetIndex(..., vectorstore=...) and save it to a directory")
        settings.pop("vectorstore", None)
        self.compressor, self.embeddings, self.settings = compressor, embeddings, settings
        self.options = options or PublishOptions()
        self.cache = SegmentCache(cache_dir) if cache_dir is not None else None
        self.pipeline = pipeline or ingest_chunks
        self._held: _Held | None = None
        self._loading = threading.Lock()  # one load at a time; questions never wait on it once a version is held
        self._swapping = threading.Lock()
        self._publishing = 0  # publishes of this process under way: they hand questions the new version at the commit
        self.current()

    @property
    def location(self) -> str:
        """Where it lives, as its ingest jobs record it: its store and name."""
        return f"{describe(self.compressor.store)}#published-index/{self.options.name}"

    @property
    def where(self) -> str:
        """The index for messages: its name and store."""
        return f"the index {self.options.name!r} published in {describe(self.compressor.store)}"

    def current(self) -> NuggetIndex:
        """The newest published version, whole (an empty index when none is published yet)."""
        found = read_pointer(self.compressor.store, self.options.name)
        raw = None if found is None else found[0]
        held = self._held
        if held is not None and (held.raw == raw or self._publishing):
            return held.index
        if not self._loading.acquire(blocking=held is None):  # another thread loads it: the held one meanwhile
            return held.index
        try:
            held = self._held
            if held is None or held.raw != raw:
                self._swap(self._load(found))
        finally:
            self._loading.release()
        return self._held.index

    def __len__(self) -> int:
        return len(self.current())

    @property
    def record(self) -> VersionRecord | None:
        """The record of the version held (read last), None when none is published: its number, manifest and
        segments."""
        return None if self._held is None else self._held.record

    def as_retriever(self, k: int = 4, **kwargs: Any) -> NuggetRetriever:
        """The current version's retriever (NuggetIndex.as_retriever)."""
        return self.current().as_retriever(k=k, **kwargs)

    def ingest(self, documents: Iterable[Document], stop: Stop | None = None) -> int:
        """Add `documents` and publish them as a new version; returns the number of new chunks. Once `stop()` is
        true the ingest stops at its next step and raises RequestCancelled, nothing published (the states it
        stored stay in the store)."""
        documents = list(documents)
        with cancellable(stop) if stop is not None else nullcontext():
            self.current()
            held = self._held
            working = held.index.copy()
            added = self.pipeline(working, documents)
            if not added:
                return 0
            store, name = self.compressor.store, self.options.name
            with self._publish_lock() as lock:
                found = read_pointer(store, name)
                if (None if found is None else found[0]) != held.raw:  # another publish landed meanwhile
                    newest = self._load(found)
                    working, added = self._rebased(newest.index, working, len(held.index))
                    held = newest
                if added:
                    base = None if held.pointer is None else (held.pointer, held.record)
                    def handed(*new: Any, working: NuggetIndex = working) -> None:  # questions get it at the commit
                        self._swap(_Held(*new, working))

                    published = publish_version(store, self.options, base, working, len(held.index), lock,
                                                cache=self.cache, committed=handed)
                    held = _Held(*published, working)
            self._swap(held)
        return added

    def compact(self) -> bool:
        """Merge every run of adjacent segments that fits in one (`options.segment_bytes`) into a new version of the
        same chunks; False when there is nothing to merge."""
        store, name = self.compressor.store, self.options.name
        with self._publish_lock() as lock:
            found = read_pointer(store, name)
            if found is None:
                return False
            held = self._held if self._held.raw == found[0] else self._load(found)
            if all(len(group) == 1 for group in merge_groups(held.record.segments, self.options, compact=True)):
                self._swap(held)
                return False
            published = publish_version(store, self.options, (held.pointer, held.record), held.index,
                                        held.record.count, lock, compact=True, cache=self.cache,
                                        committed=lambda *new: self._swap(_Held(*new, held.index)))
        self._swap(_Held(*published, held.index))
        return True

    @contextmanager
    def _publish_lock(self) -> Iterator[Any]:
        """The publish lock of the index; while it is held, this process's questions read the version held (the
        publish hands them the new one at its commit), so that none loads a version itself meanwhile."""
        with publish_lock(self.compressor.store, self.options.name) as lock:
            with self._swapping:
                self._publishing += 1
            try:
                yield lock
            finally:
                with self._swapping:
                    self._publishing -= 1

    # ------------------------------------------------------------------ loading
    def _load(self, found: tuple[bytes, Pointer] | None) -> _Held:
        """The version `found` names, read whole and checked (again from a newer pointer, should it be removed
        while it is read); an empty index when nothing is published."""
        store, name = self.compressor.store, self.options.name
        for attempt in range(self.options.load_attempts):
            if found is None:
                return _Held(None, None, None, NuggetIndex(self.compressor, self.embeddings, **self.settings))
            try:
                record, chunks, vectors = read_version(store, name, found[1].version, found[1].sha256, self.cache,
                                                       self._held_segments())
                break
            except VersionRemovedError as err:
                newer = read_pointer(store, name)
                if newer is not None and newer[0] == found[0]:  # the pointer still names it: lost, not a race
                    raise err.damage from None
                if attempt == self.options.load_attempts - 1:
                    raise IndexFileError(f"{self.where} moved on {attempt + 1} times while a version was read ({err}); "
                                         "raise PublishOptions.keep_versions, or try again") from err
                found = newer
        index = self._index_of(record, chunks, vectors)
        log.info("loaded version %d of %s: %d chunks", record.version, self.where, len(index))
        return _Held(found[0], found[1], record, index)

    def _held_segments(self) -> Callable[[SegmentRef], Segment | None] | None:
        """The segments of the version held, by sha256 (its chunks, and its vectors read back from its FAISS): a
        newer version that lists them too reads only its new ones."""
        held = self._held
        if held is None or held.record is None:
            return None
        spans, start = {}, 0
        for ref in held.record.segments:
            spans[ref.sha256] = (start, start + ref.count)
            start += ref.count
        chunks = held.index.documents

        def loaded(ref: SegmentRef) -> Segment | None:
            if ref.sha256 not in spans:
                return None
            a, b = spans[ref.sha256]
            return chunks[a:b], faiss_vectors(held.index.vectorstore, a, b)

        return loaded

    def _index_of(self, record: VersionRecord, chunks: list[Document], vectors: np.ndarray) -> NuggetIndex:
        """The NuggetIndex of a version read whole, its manifest checked against the model and settings given."""
        manifest, where = record.manifest, f"{self.where} (version {record.version})"
        if manifest.get("vectorstore") != DEFAULT_VECTORSTORE:
            raise IndexFileError(f"{where} records the vector store {manifest.get('vectorstore')!r}: only the index's "
                                 "own FAISS is published; publish the index again")
        settings = dict(self.settings)
        compressor, embeddings = built_settings(manifest, where, "another published index (PublishOptions(name=...))",
                                                self.compressor, self.embeddings, settings)
        if manifest.get("nugget_fingerprint") != compressor.fingerprint:
            raise ValueError(
                f"{where} holds nuggets of {manifest.get('nugget_model')} at r = {manifest.get('ratio')} (fingerprint "
                f"{manifest.get('nugget_fingerprint')}), not of the model given ({compressor.model.base_name}, "
                f"fingerprint {compressor.fingerprint}); open it with the checkpoint and base model it was ingested "
                "with, or publish under another name (PublishOptions(name=...))")
        index = NuggetIndex(compressor, embeddings, **settings)
        index.adopt(chunks, faiss_of(embeddings, vectors, chunks) if chunks else None, record.dimension)
        return index

    def _swap(self, held: _Held) -> None:
        """Make `held` the version questions read, unless a newer one is held already."""
        with self._swapping:
            if self._held is None or held.version >= self._held.version:
                self._held = held
                self.compressor, self.embeddings = held.index.compressor, held.index.embeddings

    # ------------------------------------------------------------------ copies
    @staticmethod
    def _vectors(index: NuggetIndex) -> np.ndarray:
        if not len(index):
            return np.zeros((0, index.dimension or 1), np.float32)
        return faiss_vectors(index.vectorstore)

    @staticmethod
    def _built(like: NuggetIndex, chunks: list[Document], vectors: np.ndarray) -> NuggetIndex:
        """A new index with the settings of `like`, holding `chunks` and their `vectors`."""
        index = NuggetIndex(like.compressor, like.embeddings, chunk_tokens=like.chunk_tokens,
                            chunk_overlap=like.chunk_overlap, show_progress=like.show_progress,
                            batch_size=like.batch_size, embedding_model=like.embedding_model)
        if chunks:
            index.adopt(chunks, faiss_of(like.embeddings, vectors, chunks))
        return index

    def _rebased(self, newest: NuggetIndex, working: NuggetIndex, since: int) -> tuple[NuggetIndex, int]:
        """`newest` and the chunks `working` added after its first `since` that `newest` lacks; how many those are."""
        known = set(newest.ids)
        ours = [(i, d) for i, d in enumerate(working.documents[since:], since) if d.id not in known]
        if not ours:
            return newest, 0
        vectors = self._vectors(working)[[i for i, _ in ours]]
        vectors = np.concatenate([self._vectors(newest), vectors]) if len(newest) else vectors
        return self._built(newest, newest.documents + [d for _, d in ours], vectors), len(ours)


__all__: list[str] = ["PublishedIndex", "cache_directory", "ingest_chunks", "published_manifest"]

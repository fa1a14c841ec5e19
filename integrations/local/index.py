"""An index of document chunks in a vector store (FAISS, or any LangChain vector store) whose nuggets live in the
compressor's store beside it: ingest, delete, retrieval, and its save and load (the files: files.py)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore

from nugget_rag.cancellation import Stop, cancellable
from nugget_rag.components.compressor import NuggetCompressor
from nugget_rag.state.store import NuggetStore

from ..ingest import pipeline as ingest_pipeline
from ..ingest.chunking import split_documents, token_splitter
from ..stores import user_store
from ..stores.embeddings import embedding_name, minilm_embeddings
from ..stores.spec import (
    check_dimension,
    check_holds,
    check_vectorstore,
    store_collection,
    store_embeddings,
    vectorstore_name,
)
from ..stores.user_store import CHUNK_IDS, UUID_IDS, check_flat, store_id
from .files import (
    INDEX_FORMAT,
    MANIFEST_FILE,
    NUGGETS_DIR,
    IndexFileError,
    encode_records,
    index_location,
    index_lock,
    keeps_store,
    read_json,
    read_records,
    store_name,
    write_index,
)
from .own_faiss import copy_faiss, empty_faiss, faiss_bytes, load_faiss
from .retriever import NuggetRetriever
from .settings import built_settings

log = logging.getLogger(__name__)

Pipeline = Callable[["NuggetIndex", list[Document]], int]  # how an ingest adds documents to an index: its new chunks


class NuggetIndex:
    """A vector store over document chunks + their nuggets in the compressor's store, filled in one `ingest` step.

    Chunks are cut by the compressor's tokenizer (`chunk_tokens`, `chunk_overlap`), embedded for retrieval
    (cosine ranking) and compressed into nuggets at once, so a later question only reads cached nuggets.
    `batch_size` chunks are compressed, embedded and indexed per step; the progress bar (`show_progress`) moves
    per step, with chunks/s, tokens/s and the time left.

    The vectors go to `vectorstore`, any LangChain VectorStore (Qdrant, Chroma, PGVector, InMemoryVectorStore...),
    under ids and with flat metadata every store takes (user_store.py); without one, to the index's own FAISS (saved
    in its directory). The index keeps its chunks' records (ids, text, metadata) either way: `delete` removes chunks
    from both.
    """

    def __init__(
        self,
        compressor: NuggetCompressor,
        embeddings: Embeddings | None = None,
        chunk_tokens: int = 384,
        chunk_overlap: int = 32,
        show_progress: bool = False,
        batch_size: int = 8,
        embedding_model: str | None = None,
        vectorstore: VectorStore | None = None,
    ):
        if chunk_tokens < 1 or not 0 <= chunk_overlap < chunk_tokens:
            raise ValueError(f"need chunk_tokens >= 1 and 0 <= chunk_overlap < chunk_tokens, "
                             f"got {chunk_tokens} and {chunk_overlap}")
        if vectorstore is not None and not isinstance(vectorstore, VectorStore):
            raise TypeError(f"vectorstore is a {type(vectorstore).__name__}, not a LangChain VectorStore; give one "
                            "(e.g. InMemoryVectorStore(embedding=...)), or leave it out for the index's own FAISS")
        embeddings = store_embeddings(vectorstore, embeddings)
        self.compressor = compressor
        self.embeddings = embeddings if embeddings is not None else minilm_embeddings()
        self.embedding_model = embedding_model or embedding_name(self.embeddings)
        self.chunk_tokens = chunk_tokens
        self.chunk_overlap = chunk_overlap
        self.show_progress = show_progress
        self.batch_size = batch_size
        self.splitter = token_splitter(compressor.model.tokenizer, chunk_tokens, chunk_overlap)
        self.user_vectorstore = vectorstore  # None: the index's own FAISS, made at the first add
        self.vectorstore: VectorStore | None = vectorstore
        self.dimension: int | None = None  # of the vectors, known at the first add (or from a saved index)
        self.store_ids = CHUNK_IDS if vectorstore is None else UUID_IDS  # how chunk ids map to the store's
        self.collection = store_collection(vectorstore)
        self._records: dict[str, Document] = {}  # chunk id -> chunk, in index order (FAISS's, for the default)
        self.last_ingest: dict[str, Any] = {}  # what the last ingest did (ingest_pipeline.ingest)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def ids(self) -> list[str]:
        """Chunk ids in index order."""
        return list(self._records)

    @property
    def documents(self) -> list[Document]:
        """The indexed chunks, in index order."""
        return list(self._records.values())

    def copy(self) -> NuggetIndex:
        """A copy to add to while questions read this one: its own records and FAISS (a user's vector store, which
        another server keeps, is shared)."""
        twin = copy.copy(self)
        twin._records, twin.last_ingest = dict(self._records), dict(self.last_ingest)
        if self.user_vectorstore is None and self.vectorstore is not None:
            twin.vectorstore = copy_faiss(self.vectorstore, twin._records)
        return twin

    @property
    def vectorstore_name(self) -> str:
        """What the manifest records of where the vectors live: "faiss", or the user's store's "module:Class"."""
        return vectorstore_name(self.user_vectorstore)

    # ------------------------------------------------------------------ ingest
    def split(self, documents: Sequence[Document]) -> list[Document]:
        """Token-aware chunks of `documents`, each with a deterministic id, its document's `source` and
        `chunk`/`start_index` metadata (chunking.split_documents); for the user's vector store, metadata it can keep
        (user_store.check_flat), else a ValueError before anything is compressed or written."""
        chunks = split_documents(self.splitter, documents)
        if self.user_vectorstore is not None:
            check_flat(chunks)
        return chunks

    def store_ids_of(self, ids: Sequence[str]) -> list[str]:
        """The ids the chunks `ids` have in the vector store (user_store.store_id)."""
        return [store_id(i, self.store_ids, self.collection) for i in ids]

    def ingest(self, documents: Iterable[Document], stop: Stop | None = None) -> int:
        """Split, compress into the nugget store and add to the vector store; returns the number of new chunks
        (ingest_pipeline.ingest: its stages, and `stop`).

        Chunks whose id is already indexed are skipped (re-ingesting a text adds nothing). Each batch is
        compressed before it is indexed, so every indexed chunk has its nuggets in the store.
        """
        return ingest_pipeline.ingest(self, documents, stop)

    def add_chunks(self, docs: Sequence[Document], vectors: Sequence[Sequence[float]]) -> None:
        """Add split, compressed chunks (each with its id) and their vectors from `embeddings` to the vector store
        and the records. A vector store that takes vectors (`add_embeddings`, as FAISS) is given them; any other
        embeds the chunks itself, with the same embeddings. A first add checks the store's dimension, where the
        store tells it, against the vectors'."""
        if not docs:
            return
        if self.dimension is None:
            if self.vectorstore is not None:
                check_dimension(self.vectorstore, list(vectors[0]), self.embedding_model)
            self.dimension = len(vectors[0])
        ids = [d.id for d in docs]
        if self.vectorstore is None:
            self.vectorstore = empty_faiss(self.embeddings, len(vectors[0]))
        if self.user_vectorstore is None:
            self.vectorstore.add_embeddings([(d.page_content, list(v)) for d, v in zip(docs, vectors)],
                                            metadatas=[d.metadata for d in docs], ids=ids)
        else:
            user_store.add(self.vectorstore, docs, vectors, self.store_ids_of(ids))
        self._records.update(zip(ids, docs))

    def delete(self, ids: Sequence[str]) -> int:
        """Remove the chunks `ids` from the vector store and the records; returns how many were removed.

        Their nuggets stay in the store (other chunks, and other indexes, may share them): `prune` removes the
        states no index references. Nothing is removed when an id is not in the index, or when the vector store
        cannot delete."""
        ids = list(dict.fromkeys(ids))
        unknown = [i for i in ids if i not in self._records]
        if unknown:
            raise ValueError(f"{len(unknown)} of the ids to delete are not in the index, e.g. {unknown[0]!r}; "
                             "nothing was deleted (index.ids lists the chunks)")
        if not ids:
            return 0
        user_store.delete(self.vectorstore, self.store_ids_of(ids))
        for i in ids:
            del self._records[i]
        return len(ids)

    # ------------------------------------------------------------------ retrieval
    def as_retriever(self, k: int = 4, **kwargs: Any) -> NuggetRetriever:
        """A retriever of the `k` most similar chunks (add `| compressor` to read their nuggets); `kwargs` are
        NuggetRetriever's (search_type, search_kwargs, tags, ...)."""
        if self.vectorstore is None or not len(self):
            raise ValueError("the index is empty: ingest documents first")
        tags = kwargs.pop("tags", None) or [type(self.vectorstore).__name__, type(self.embeddings).__name__]
        return NuggetRetriever(vectorstore=self.vectorstore, k=k, tags=tags, **kwargs)  # user_store.from_store

    # ------------------------------------------------------------------ persistence
    def manifest(self) -> dict[str, Any]:
        model = self.compressor.model
        return {
            "format": INDEX_FORMAT,
            "embedding_model": self.embedding_model,
            "dimension": self.dimension,
            "vectorstore": self.vectorstore_name,
            "store_ids": self.store_ids,
            "collection": self.collection,
            "distance": "l2 over unit vectors (cosine ranking)" if self.user_vectorstore is None else "the store's",
            "count": len(self),
            "nugget_model": model.base_name,
            "nugget_fingerprint": self.compressor.fingerprint,
            "ratio": self.compressor.effective_ratio,
            "keep_ratio": self.compressor.keep_ratio,
            "chunk_tokens": self.chunk_tokens,
            "chunk_overlap": self.chunk_overlap,
            "nugget_store": store_name(self.compressor.store),
        }

    def save(self, directory: str | Path) -> Path:
        """Write the index, its chunks and (if they live elsewhere) their nuggets into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        nuggets = self.compressor.store
        if not keeps_store(nuggets, directory / NUGGETS_DIR):
            nuggets = NuggetStore(directory=directory / NUGGETS_DIR)
            self._copy_nuggets(nuggets)
        docstore = encode_records(self.documents, self.ids, directory)  # before anything is written
        own_faiss = self.user_vectorstore is None and self.vectorstore is not None
        write_index(directory, self.manifest(), docstore, faiss_bytes(self.vectorstore) if own_faiss else None)
        if nuggets.location is not None and nuggets.location.is_redis:  # a store other indexes share: what prune keeps
            nuggets.register_index(index_location(directory))
        return directory

    def _copy_nuggets(self, target: NuggetStore) -> None:
        docs = self.documents
        for start in range(0, len(docs), 64):
            batch = docs[start : start + 64]
            for doc, found in zip(batch, self.compressor.lookup(batch)):
                target.put(doc.page_content, found.stored)
            if self.compressor.text_states:  # and the frozen model's, which questions read passages whole from
                for doc, found in zip(batch, self.compressor.lookup(batch, 1.0, adapter=None)):
                    target.put(doc.page_content, found.stored)

    @classmethod
    def load(
        cls,
        directory: str | Path,
        compressor: NuggetCompressor,
        embeddings: Embeddings | None = None,
        **kwargs: Any,
    ) -> NuggetIndex:
        """Open a saved index; the compressor reads and writes nuggets in `directory/nuggets`, or in the Redis store
        it has (`NuggetStore.from_redis`) when the index was saved with its nuggets there.

        An index whose vectors live in the user's vector store opens with that store (`vectorstore=` in `kwargs`,
        whose embeddings it takes when `embeddings` is None).

        Raises FileNotFoundError or IndexFileError naming a missing or damaged file, and ValueError when
        `embeddings` are not the model the index was built with, the compressor's store is not the index's, or the
        vector store is not the one the index was built into.
        """
        directory = Path(directory)
        manifest = read_json(directory / MANIFEST_FILE)
        if manifest.get("format") != INDEX_FORMAT:
            raise IndexFileError(f"{directory / MANIFEST_FILE} has format {manifest.get('format')!r}, "
                                 f"expected {INDEX_FORMAT!r}")
        check_vectorstore(directory, manifest, kwargs.get("vectorstore"))
        store_dir = directory / NUGGETS_DIR
        saved_store, given_store = manifest.get("nugget_store", "directory"), store_name(compressor.store)
        if saved_store.startswith("redis") and saved_store != given_store:
            namespace = saved_store.partition(":")[2]
            raise ValueError(f"the nuggets of the index in {directory} live in Redis (namespace {namespace!r}); open it "
                             f"with a compressor on that store, NuggetStore.from_redis(URL, namespace={namespace!r}) "
                             "(--store URL on the command line)")
        if given_store.startswith("redis") and saved_store != given_store:
            raise ValueError(f"the index in {directory} keeps its nuggets in {saved_store}, not in Redis "
                             f"({given_store}); open it without the Redis store (no --store)")
        if not keeps_store(compressor.store, store_dir):
            compressor = compressor.model_copy(update={"store": NuggetStore(directory=store_dir)})
        compressor, embeddings = built_settings(manifest, f"the index in {directory}", "a new index directory",
                                                compressor, embeddings, kwargs)
        index = cls(compressor, embeddings, **kwargs)
        fingerprint = compressor.fingerprint
        if manifest.get("nugget_fingerprint") != fingerprint:
            log.warning("the nuggets in %s were made by another nugget model or ratio (%s, r=%s); they will be "
                        "recomputed when read", store_dir, manifest.get("nugget_model"), manifest.get("ratio"))
        if not manifest.get("count"):
            return index
        docs, order = read_records(directory, manifest)
        if index.user_vectorstore is None:
            index.adopt([docs[i] for i in order], load_faiss(directory, manifest, index.embeddings, docs, order))
        else:
            index.store_ids = manifest.get("store_ids", CHUNK_IDS)  # an index saved before UUIDs: its chunks' ids
            index.collection = manifest.get("collection", index.collection)  # its ids' collection, as recorded
            check_holds(index.user_vectorstore, directory, dict(zip(index.store_ids_of(order), order)))
            index.adopt([docs[i] for i in order], None, manifest.get("dimension"))
        return index

    def adopt(self, chunks: Sequence[Document], faiss: VectorStore | None, dimension: int | None = None) -> None:
        """Hold `chunks` (in index order) as the records of a new, empty index, and `faiss`, the index's own FAISS
        over them as a loaded or published index keeps it (None: the user's vector store holds them, its vectors of
        `dimension`)."""
        if self._records:
            raise ValueError(f"the index holds {len(self)} chunks already: only a new, empty index adopts chunks")
        if faiss is not None:
            self.vectorstore, dimension = faiss, faiss.index.d
        self.dimension = dimension
        self._records = {d.id: d for d in chunks}

    @classmethod
    def open(cls, directory: str | Path, compressor: NuggetCompressor, embeddings: Embeddings | None = None,
             **kwargs: Any) -> NuggetIndex:
        """`load` the index in `directory` if there is one, else a new empty one whose nuggets go there (or to the
        compressor's Redis store)."""
        directory = Path(directory)
        if (directory / MANIFEST_FILE).exists():
            return cls.load(directory, compressor, embeddings, **kwargs)
        store_dir = directory / NUGGETS_DIR
        if not keeps_store(compressor.store, store_dir):
            compressor = compressor.model_copy(update={"store": NuggetStore(directory=store_dir)})
        return cls(compressor, embeddings, **kwargs)

    @classmethod
    @contextmanager
    def updating(cls, directory: str | Path, compressor: NuggetCompressor, embeddings: Embeddings | None = None,
                 **kwargs: Any) -> Iterator[NuggetIndex]:
        """`open` the index in `directory`, yield it, then `save` it, holding the directory's lock throughout, so
        that concurrent updates (two `nugget-rag ingest` runs) take turns and every one of them lands."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with index_lock(directory):
            index = cls.open(directory, compressor, embeddings, **kwargs)
            yield index
            index.save(directory)


def ingest_into_directory(directory: str | Path, compressor: NuggetCompressor, embeddings: Embeddings | None,
                          documents: Iterable[Document], stop: Stop | None = None, pipeline: Pipeline | None = None,
                          **kwargs: Any) -> tuple[NuggetIndex, int]:
    """Open the index in `directory` (a new one where none is saved) under its lock, add `documents` with `pipeline`
    (default `NuggetIndex.ingest`: split, compress, embed, add) and save it: the index as saved and its new chunks.
    Once `stop()` is true the pipeline stops at its next step (RequestCancelled) and nothing is saved. `kwargs` are
    NuggetIndex's. The one update of a directory that `nugget-rag ingest`, `jobs resume` and the served indexes
    (serving/local_index.py, serving/ray_serve.py) make."""
    with NuggetIndex.updating(directory, compressor, embeddings, **kwargs) as index:
        with cancellable(stop) if stop is not None else nullcontext():
            added = (pipeline or NuggetIndex.ingest)(index, list(documents))
    return index, added


__all__: list[str] = ["NuggetIndex", "Pipeline", "ingest_into_directory"]

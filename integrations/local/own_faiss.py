"""The index's own vector store, when the user brings none: a FAISS index of unit vectors (L2 distance, cosine
ranking), saved as its `faiss.serialize_index` bytes."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

try:
    import faiss
except ImportError as err:  # a core install: retrieval is an extra
    raise ImportError(f"{err.name} is not installed: nugget-rag's FAISS retrieval needs its [retrieval] extra "
                      "(pip install 'nugget-rag[retrieval]')") from err
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings

from .files import MANIFEST_FILE, IndexFileError, data_files, read_content

with warnings.catch_warnings():  # langchain-community announces its sunset on import
    warnings.simplefilter("ignore")
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy


def new_faiss(embeddings: Embeddings, index: Any, docs: dict[str, Document], mapping: dict[int, str]) -> FAISS:
    """LangChain's FAISS over the faiss `index`, its chunks `docs` and `mapping` (position -> chunk id)."""
    # L2 distance between unit vectors ranks as cosine similarity, for any embeddings
    return FAISS(embeddings, index, InMemoryDocstore(docs), mapping, normalize_L2=True,
                 distance_strategy=DistanceStrategy.EUCLIDEAN_DISTANCE)


def empty_faiss(embeddings: Embeddings, dimension: int) -> FAISS:
    """An empty FAISS for vectors of `dimension`."""
    return new_faiss(embeddings, faiss.IndexFlatL2(dimension), {}, {})


def copy_faiss(vectorstore: FAISS, docs: dict[str, Document]) -> FAISS:
    """A copy of `vectorstore` over the chunks `docs` (its own): adding to either leaves the other as it is."""
    return new_faiss(vectorstore.embedding_function, faiss.clone_index(vectorstore.index), dict(docs),
                     dict(vectorstore.index_to_docstore_id))


def faiss_vectors(vectorstore: FAISS, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The unit vectors `vectorstore` holds at positions [start, stop) (default: all), as a float32 array of shape
    (count, dimension); a ValueError for a FAISS index that does not keep its vectors as they are (not a flat one)."""
    index = vectorstore.index
    if not isinstance(index, faiss.IndexFlat):
        raise ValueError(f"the FAISS index is a {type(index).__name__}, not the flat index nugget-rag builds: its "
                         "vectors cannot be read back; build the index with nugget-rag (NuggetIndex)")
    stop = index.ntotal if stop is None else stop
    return index.reconstruct_n(start, stop - start).reshape(stop - start, index.d)


def faiss_of(embeddings: Embeddings, vectors: np.ndarray, chunks: Sequence[Document]) -> FAISS:
    """The index's own FAISS over `chunks` (in index order) and their unit `vectors`, as faiss_vectors reads them."""
    index = faiss.IndexFlatL2(vectors.shape[1])
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    return new_faiss(embeddings, index, {d.id: d for d in chunks}, dict(enumerate(d.id for d in chunks)))


def faiss_bytes(vectorstore: FAISS) -> bytes:
    """The vectors of `vectorstore` as the index file holds them."""
    return faiss.serialize_index(vectorstore.index).tobytes()


def load_faiss(directory: Path, manifest: dict[str, Any], embeddings: Embeddings, docs: dict[str, Document],
               order: list[str]) -> FAISS:
    """The FAISS saved in `directory`, over the chunks `docs` in `order`; an IndexFileError when its file is missing
    from the manifest, damaged, or does not match the manifest and the docstore."""
    files = data_files(manifest, directory)
    if "faiss" not in files:
        raise IndexFileError(f"{directory / MANIFEST_FILE} counts {manifest.get('count')} chunks but names no "
                             "FAISS file; ingest the documents again into a new directory")
    faiss_path = directory / files["faiss"]["name"]
    vectors = read_content(faiss_path, files["faiss"].get("sha256"))
    try:
        index = faiss.deserialize_index(np.frombuffer(vectors, dtype=np.uint8))
    except RuntimeError as err:
        raise IndexFileError(f"{faiss_path} is truncated or not a FAISS index ({str(err).splitlines()[0]}); "
                             "ingest the documents again into a new directory") from err
    if manifest.get("dimension") not in (None, index.d):
        raise IndexFileError(f"{faiss_path} holds vectors of dimension {index.d}, the manifest says "
                             f"{manifest['dimension']}: the files do not belong together")
    if index.ntotal != len(order):
        raise IndexFileError(f"{faiss_path} holds {index.ntotal} vectors, the docstore maps {len(order)}: the "
                             "files do not belong together")
    return new_faiss(embeddings, index, dict(docs), dict(enumerate(order)))


__all__: list[str] = ["copy_faiss", "empty_faiss", "faiss_bytes", "faiss_of", "faiss_vectors", "load_faiss", "new_faiss"]

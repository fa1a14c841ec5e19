"""What a NuggetIndex needs of a vector store beyond LangChain's VectorStore, one module an engine's quirks
(faiss.py, pgvector.py, qdrant.py, chroma.py, memory.py) behind this small interface; any other store takes its
defaults. A new engine is a module: an Engine subclass, listed in engines.py. Each engine knows its stores by what
they do (their methods and settings), not by their class, so that a subclass, or a store of the same kind, is served
alike.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.vectorstores import VectorStore


class Engine:
    """A vector store's quirks; these defaults serve any LangChain VectorStore."""

    checks_by_search = True  # whether a search with one vector tells a store of another dimension (check_dimension)

    def handles(self, vectorstore: VectorStore) -> bool:
        """Whether `vectorstore` is one of this engine's."""
        return True

    def add(self, vectorstore: VectorStore, texts: list[str], vectors: list[list[float]],
            metadatas: list[dict[str, Any]], ids: list[str]) -> Sequence[str] | None:
        """Add the chunks under `ids`; returns the ids the store gives back. Here, as documents it embeds itself."""
        return vectorstore.add_documents([Document(page_content=t, metadata=m) for t, m in zip(texts, metadatas)],
                                         ids=ids)

    def address(self, vectorstore: VectorStore) -> str | None:
        """Where the store's engine is, where the store tells it publicly; None: it does not."""
        return None

    def dimension(self, vectorstore: VectorStore) -> int | None:
        """The dimension of the vectors the store holds or was made for, where it tells: a `dimension` setting."""
        return integer(getattr(vectorstore, "dimension", None))

    def collection(self, vectorstore: VectorStore) -> str | None:
        """The collection the store writes to, where it names one (`collection_name`, LangChain's setting)."""
        name = getattr(vectorstore, "collection_name", None)
        return name if isinstance(name, str) else None


def integer(value: Any) -> int | None:
    """`value` if it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def vector_parameters(vectorstore: VectorStore) -> set[str]:
    """The parameters of the store's `add_embeddings`, which takes vectors as they are (none: it has none)."""
    add_embeddings = getattr(vectorstore, "add_embeddings", None)
    if not callable(add_embeddings):
        return set()
    try:
        return set(inspect.signature(add_embeddings).parameters)
    except (TypeError, ValueError):
        return set()


__all__ = ["Engine", "integer", "vector_parameters"]

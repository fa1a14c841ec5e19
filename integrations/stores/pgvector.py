"""PGVector (langchain-postgres): it takes vectors as a list beside the texts, keeps every collection's ids in one
table (so an id names its collection: user_store.store_id), and is made for one dimension (`embedding_length`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.vectorstores import VectorStore

from .engine import Engine, integer, vector_parameters


class PGVectorEngine(Engine):
    def handles(self, vectorstore: VectorStore) -> bool:
        return {"texts", "embeddings"} <= vector_parameters(vectorstore)

    def add(self, vectorstore: VectorStore, texts: list[str], vectors: list[list[float]],
            metadatas: list[dict[str, Any]], ids: list[str]) -> Sequence[str] | None:
        return vectorstore.add_embeddings(texts, vectors, metadatas=metadatas, ids=ids)

    def dimension(self, vectorstore: VectorStore) -> int | None:
        return integer(getattr(vectorstore, "embedding_length", None)) or super().dimension(vectorstore)


__all__ = ["PGVectorEngine"]

"""LangChain's FAISS as the user's store (the index's own FAISS files: local/own_faiss.py): it takes vectors as
(text, vector) pairs, and its index tells their dimension (`d`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.vectorstores import VectorStore

from .engine import Engine, integer, vector_parameters


class FaissEngine(Engine):
    def handles(self, vectorstore: VectorStore) -> bool:
        return "text_embeddings" in vector_parameters(vectorstore)

    def add(self, vectorstore: VectorStore, texts: list[str], vectors: list[list[float]],
            metadatas: list[dict[str, Any]], ids: list[str]) -> Sequence[str] | None:
        return vectorstore.add_embeddings(list(zip(texts, vectors)), metadatas=metadatas, ids=ids)

    def dimension(self, vectorstore: VectorStore) -> int | None:
        return integer(getattr(getattr(vectorstore, "index", None), "d", None))


__all__ = ["FaissEngine"]

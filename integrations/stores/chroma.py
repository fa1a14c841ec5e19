"""Chroma (langchain-chroma): it keeps its collection's name as `_collection_name`, not LangChain's public
`collection_name`, and names it nowhere else (tests/test_vector_databases.py holds that it is recorded)."""

from __future__ import annotations

from langchain_core.vectorstores import VectorStore

from .engine import Engine


class ChromaEngine(Engine):
    def handles(self, vectorstore: VectorStore) -> bool:
        return isinstance(getattr(vectorstore, "_collection_name", None), str)

    def collection(self, vectorstore: VectorStore) -> str | None:
        return super().collection(vectorstore) or getattr(vectorstore, "_collection_name")


__all__ = ["ChromaEngine"]

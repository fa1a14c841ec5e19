"""LangChain's InMemoryVectorStore: its first vector tells the dimension, and a search tells nothing of another
dimension (it compares any two vectors), so none is made to check one."""

from __future__ import annotations

from langchain_core.vectorstores import InMemoryVectorStore, VectorStore

from .engine import Engine


class InMemoryEngine(Engine):
    checks_by_search = False

    def handles(self, vectorstore: VectorStore) -> bool:
        return isinstance(vectorstore, InMemoryVectorStore)

    def dimension(self, vectorstore: VectorStore) -> int | None:
        first = next(iter(vectorstore.store.values()), None)
        return None if first is None else len(first["vector"])


__all__ = ["InMemoryEngine"]

"""The engines whose quirks a NuggetIndex knows (engine.py), in the order they are asked whether a store is theirs."""

from __future__ import annotations

from langchain_core.vectorstores import VectorStore

from .chroma import ChromaEngine
from .engine import Engine
from .faiss import FaissEngine
from .memory import InMemoryEngine
from .pgvector import PGVectorEngine
from .qdrant import QdrantEngine

ENGINES: list[Engine] = [FaissEngine(), PGVectorEngine(), QdrantEngine(), ChromaEngine(), InMemoryEngine()]


def engine_of(vectorstore: VectorStore) -> Engine:
    """The engine `vectorstore` is one of: the first of ENGINES that handles it, else the defaults (Engine)."""
    return next((engine for engine in ENGINES if engine.handles(vectorstore)), Engine())


__all__ = ["ENGINES", "engine_of"]

"""Qdrant (langchain-qdrant): it takes only UUIDs and integers as ids (user_store.store_id makes UUIDs), and its
client tells where the engine is (its `init_options`: a URL, a location, a path or a host and port)."""

from __future__ import annotations

from typing import Any

from langchain_core.vectorstores import VectorStore

from .engine import Engine


def client_options(vectorstore: VectorStore) -> dict[str, Any] | None:
    options = getattr(getattr(vectorstore, "client", None), "init_options", None)
    return options if isinstance(options, dict) else None


class QdrantEngine(Engine):
    def handles(self, vectorstore: VectorStore) -> bool:
        return client_options(vectorstore) is not None

    def address(self, vectorstore: VectorStore) -> str | None:
        options = client_options(vectorstore) or {}
        for name in ("url", "location", "path", "host"):
            if isinstance(options.get(name), str):
                return options[name] + (f":{options['port']}" if name == "host" and options.get("port") else "")
        return None


__all__ = ["QdrantEngine", "client_options"]

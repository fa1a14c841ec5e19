"""A NuggetIndex's chunks in the user's vector store: what it writes there and reads back, and its adds and
deletes, each whole or refused with nothing written.

Ids: a UUID derived from the chunk's id (and the store's collection, where it names one: PGVector keeps every
collection's ids in one table), so that every store takes it (Qdrant takes only UUIDs and integers) and a chunk
ingested again lands on itself. Metadata: flat, str, int, float and bool values only (what Chroma, Qdrant and
PGVector all keep); the chunk's nugget record goes as one JSON string, its own id under `chunk_id`, and both are read
back as they were. The index's own FAISS keeps the chunks as they are, under their ids.

An add checks the ids the store returns; an engine that does not answer is named, with its address where the store
tells it (EngineUnavailable).
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from langchain_core.documents import Document
from langchain_core.vectorstores import VectorStore

from nugget_rag.components.compressor import METADATA_KEY
from nugget_rag.state.redaction import redacted

from .engines import engine_of

UUID_IDS = "uuid5"  # the manifest's "store_ids": uuid5(NAMESPACE, "collection/chunk id")
CHUNK_IDS = "chunk id"  # the chunk's own id: FAISS's, and a user's store's in an index saved before UUID_IDS
NAMESPACE = uuid.uuid5(uuid.NAMESPACE_DNS, "chunks.nugget-rag")  # fixed: a chunk's id in a store never changes
CHUNK_ID_KEY = "chunk_id"  # the metadata key a chunk's own id is kept under in the store
FLAT_TYPES = (str, int, float, bool)


def store_id(chunk_id: str, scheme: str, collection: str | None = None) -> str:
    """The id a chunk has in the user's store under `scheme` (UUID_IDS or CHUNK_IDS)."""
    if scheme == CHUNK_IDS:
        return chunk_id
    return str(uuid.uuid5(NAMESPACE, f"{collection or ''}/{chunk_id}"))


def check_flat(chunks: Sequence[Document]) -> None:
    """Refuse, naming the first, a chunk whose metadata a vector store cannot keep as it is: a value that is not a
    str, int, float or bool (a list, a dict, None), or the key the index keeps the chunk's id under."""
    for chunk in chunks:
        for key, value in chunk.metadata.items():
            if key == CHUNK_ID_KEY:
                raise ValueError(f"a chunk of {chunk.metadata.get('source')!r} has metadata {key!r}={value!r}: the "
                                 f"index keeps each chunk's id under {key!r} in the vector store; rename that key in "
                                 "the documents' metadata; nothing was ingested")
            if key != METADATA_KEY and not isinstance(value, FLAT_TYPES):
                raise ValueError(f"a chunk of {chunk.metadata.get('source')!r} has metadata {key!r}={value!r} (a "
                                 f"{type(value).__name__}), which a vector store cannot keep: give str, int, float "
                                 f"or bool values (e.g. json.dumps it, or leave {key!r} out); nothing was ingested")


def to_store(chunk: Document) -> dict[str, Any]:
    """The flat metadata of a compressed chunk in the user's store: its nugget record as JSON, its id beside it."""
    meta = {k: v for k, v in chunk.metadata.items() if k != METADATA_KEY}
    if METADATA_KEY in chunk.metadata:
        meta[METADATA_KEY] = json.dumps(chunk.metadata[METADATA_KEY], sort_keys=True)
    return {**meta, CHUNK_ID_KEY: chunk.id}


def from_store(doc: Document) -> Document:
    """A chunk as the index wrote it (`to_store`), from the document the user's store gives back: its nugget record
    and id restored (documents of the index's own FAISS, and of stores written before, are returned as they are)."""
    meta = dict(doc.metadata)
    chunk_id, record = meta.pop(CHUNK_ID_KEY, None), meta.get(METADATA_KEY)
    if isinstance(record, str):
        try:
            meta[METADATA_KEY] = json.loads(record)
        except json.JSONDecodeError:
            pass  # not the index's: left as the store holds it
    return Document(id=chunk_id if isinstance(chunk_id, str) else doc.id, page_content=doc.page_content,
                    metadata=meta)



CONNECTION_ERRORS = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError, TimeoutError, socket.gaierror)
WORDED_ERRORS = {"ConnectError", "OperationalError", "ConnectionError"}  # a client's: "does not answer" if it says so
NOT_ANSWERING = ("connection refused", "connection reset", "timed out", "timeout expired", "could not translate host",
                 "name or service not known", "temporary failure in name resolution", "nodename nor servname",
                 "no address associated with hostname", "failed to resolve host", "getaddrinfo failed")


class EngineUnavailable(ConnectionError):
    """The engine behind the user's vector store does not answer."""


def unreachable(err: BaseException | None) -> bool:
    """Whether `err`, or an error it wraps, says the engine does not answer: a connection refused, reset or timed
    out, or a host name that does not resolve (an OSError of those kinds; httpx's ConnectTimeout; httpx's
    ConnectError, SQLAlchemy's and psycopg's OperationalError or a client's ConnectionError whose message says one of
    them). An error wraps the one it was raised `from`, or one it holds (`raise Wrapper(err)`, as qdrant-client
    does); an error merely raised while another was being handled wraps nothing."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        names = {cls.__name__ for cls in type(err).__mro__}
        if isinstance(err, CONNECTION_ERRORS) or "ConnectTimeout" in names:
            return True
        if names & WORDED_ERRORS and any(words in str(err).lower() for words in NOT_ANSWERING):
            return True
        context = err.__context__
        err = err.__cause__ or (context if any(a is context for a in err.args) else None)
    return False


@contextmanager
def answering(vectorstore: VectorStore, doing: str) -> Iterator[None]:
    """Run a call to the store (`doing`: what for, e.g. "add 8 chunks"), an engine that does not answer raised as
    EngineUnavailable, naming the store and its address."""
    try:
        yield
    except Exception as err:
        if not unreachable(err):
            raise
        address = engine_of(vectorstore).address(vectorstore)
        where = f" at {redacted(address)}" if address else ""
        raise EngineUnavailable(f"the engine of the vector store {type(vectorstore).__name__}{where} does not answer "
                                f"({type(err).__name__}: {redacted(str(err))}); could not {doing}. Start it, or fix "
                                "its address in the store's settings") from err


def add(vectorstore: VectorStore, chunks: Sequence[Document], vectors: Sequence[Sequence[float]],
        ids: Sequence[str]) -> None:
    """Put compressed `chunks` into the user's store under `ids`, with flat metadata, as its engine takes them
    (engine.py: vectors where the store takes them, else documents it embeds). A store that returns other ids than it
    was given is refused, what it added deleted again."""
    metadatas = [to_store(chunk) for chunk in chunks]
    texts, vectors = [c.page_content for c in chunks], [list(v) for v in vectors]
    with answering(vectorstore, f"add {len(chunks)} chunks"):
        returned = engine_of(vectorstore).add(vectorstore, texts, vectors, metadatas, list(ids))
    if returned is not None and list(returned) != list(ids):
        other = [i for i in returned if i not in set(ids)]
        try:
            vectorstore.delete(list(returned))
        except NotImplementedError:
            pass
        raise ValueError(f"the vector store {type(vectorstore).__name__} was given {len(ids)} chunks with ids (e.g. "
                         f"{ids[0]!r}) and returned other ids ({len(returned)}, e.g. "
                         f"{(other or list(returned) or ['none'])[0]!r}); what it added was deleted. Use a store that "
                         "keeps the ids it is given")


def delete(vectorstore: VectorStore, ids: Sequence[str]) -> None:
    """Delete `ids` from the user's store, or a ValueError before anything is deleted where it cannot."""
    if type(vectorstore).delete is VectorStore.delete:
        raise ValueError(f"the vector store ({type(vectorstore).__name__}) cannot delete by id (it does not "
                         "implement VectorStore.delete); nothing was deleted. Use a store that can, or ingest "
                         "the documents to keep into a new index")
    with answering(vectorstore, f"delete {len(ids)} chunks"):
        deleted = vectorstore.delete(list(ids))
    if deleted is False:
        raise ValueError(f"the vector store ({type(vectorstore).__name__}) refused to delete {len(ids)} "
                         "chunks; the index's records were left as they were")


__all__ = ["CHUNK_IDS", "CHUNK_ID_KEY", "UUID_IDS", "EngineUnavailable", "add", "answering", "check_flat", "delete",
           "from_store", "store_id", "to_store", "unreachable"]

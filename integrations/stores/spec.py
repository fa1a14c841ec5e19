"""The user's own vector store behind a NuggetIndex, named where no Python object can be passed: on the command line
(`--vectorstore MODULE:NAME --vectorstore-kwargs JSON`) and to Ray Serve replicas, which each build their own.

    VectorStoreSpec(target="langchain_chroma:Chroma", kwargs={"persist_directory": "chroma"}).build(embeddings)

`target` names a LangChain VectorStore class, or any function returning one (a factory of your own); it is called
with `kwargs` and the index's embeddings, under the name its signature takes them by (`embedding`, `embeddings` or
`embedding_function`). The module is imported because you named it: a saved index records only the store's class,
and is opened with the store named again.

The functions below check such a store against the index it serves: the embeddings, the dimension of its vectors, and
whether it is the store (and holds the chunks) a saved index was built into.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore
from pydantic import BaseModel, ConfigDict, Field, field_validator

from nugget_rag.state.redaction import redacted

from .embeddings import embedding_name
from .engines import engine_of
from .user_store import EngineUnavailable, answering, from_store, unreachable

EMBEDDING_ARGUMENTS = ("embedding", "embeddings", "embedding_function")  # what LangChain's stores call them
DEFAULT_VECTORSTORE = "faiss"  # the manifest's "vectorstore" for the index's own FAISS files


class VectorStoreSpec(BaseModel):
    """A vector store to build: `target` ("module:Name", a VectorStore class or a factory) called with `kwargs`."""

    model_config = ConfigDict(frozen=True)

    target: str = Field(description="module:Name of a LangChain VectorStore class, or of a function returning one")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="its settings (JSON values)")

    @field_validator("target")
    @classmethod
    def _module_and_name(cls, value: str) -> str:
        module, colon, name = value.partition(":")
        if not (colon and module and name):
            raise ValueError(f"vector store {value!r} is not MODULE:NAME; name a class or factory, e.g. "
                             "langchain_core.vectorstores:InMemoryVectorStore")
        return value

    def factory(self) -> Callable[..., Any]:
        """The class or function `target` names (its module imported)."""
        module_name, _, name = self.target.partition(":")
        try:
            found: Any = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"cannot import {module_name!r} for the vector store {self.target!r} ({err}); install "
                             "the package that provides it, or fix the name") from err
        for part in name.split("."):
            if not hasattr(found, part):
                raise ValueError(f"{module_name!r} has no {name!r}: the vector store {self.target!r} names nothing; "
                                 "fix the name (MODULE:CLASS or MODULE:FUNCTION)")
            found = getattr(found, part)
        if not callable(found):
            raise ValueError(f"{self.target!r} is a {type(found).__name__}, not a vector store class or factory")
        return found

    def build(self, embeddings: Embeddings) -> VectorStore:
        """The vector store, made with `kwargs` and `embeddings` (unless `kwargs` names its embeddings itself)."""
        factory = self.factory()
        kwargs = dict(self.kwargs)
        try:
            parameters = inspect.signature(factory).parameters
        except (TypeError, ValueError):  # a builtin with no signature
            parameters = {}
        name = next((n for n in EMBEDDING_ARGUMENTS if n in parameters), None)
        if name is not None and not any(n in kwargs for n in EMBEDDING_ARGUMENTS):
            kwargs[name] = embeddings
        try:
            store = factory(**kwargs)
        except TypeError as err:
            raise ValueError(f"the vector store {self.target!r} does not take the settings "
                             f"{sorted(self.kwargs)} ({err}); fix --vectorstore-kwargs") from err
        except Exception as err:
            if not unreachable(err):
                raise
            raise EngineUnavailable(f"the engine of the vector store {self.target!r} does not answer at the address "
                                    f"its settings give ({json.dumps(redacted(self.kwargs), default=str)}): "
                                    f"{type(err).__name__}: {redacted(str(err))}. "
                                    "Start it, or fix the address in --vectorstore-kwargs") from err
        if not isinstance(store, VectorStore):
            raise ValueError(f"{self.target!r} made a {type(store).__name__}, not a LangChain VectorStore; name a "
                             "VectorStore class, or a function returning one")
        return store


def vectorstore_name(vectorstore: VectorStore | None) -> str:
    """What a manifest records of where the vectors live: "faiss" (None: the index's own), else "module:Class"."""
    if vectorstore is None:
        return DEFAULT_VECTORSTORE
    return f"{type(vectorstore).__module__}:{type(vectorstore).__qualname__}"


def store_embeddings(vectorstore: VectorStore | None, embeddings: Embeddings | None) -> Embeddings | None:
    """The embeddings of an index over `vectorstore`: the store's own (`embeddings`, when given, must be the same
    model)."""
    own = vectorstore.embeddings if vectorstore is not None else None
    if own is None:
        return embeddings
    if embeddings is not None and embedding_name(embeddings) != embedding_name(own):
        raise ValueError(f"the vector store ({type(vectorstore).__name__}) embeds with {embedding_name(own)!r}, but "
                         f"embeddings={embedding_name(embeddings)!r} were given; give the store the index's "
                         "embeddings, or leave embeddings out (the store's are used)")
    return own


def store_collection(vectorstore: VectorStore | None) -> str | None:
    """The collection the store writes to, where it names one (its engine's `collection`)."""
    return None if vectorstore is None else engine_of(vectorstore).collection(vectorstore)


def store_dimension(vectorstore: VectorStore | None) -> int | None:
    """The dimension of the vectors `vectorstore` holds or was made for, where its engine tells."""
    return None if vectorstore is None else engine_of(vectorstore).dimension(vectorstore)


def check_dimension(vectorstore: VectorStore, vector: list[float], embedding_model: str) -> None:
    """Refuse a store whose vectors have another dimension than `vector` (the embeddings'), before the first add:
    where it tells its dimension (store_dimension), else where a search with `vector` fails (Qdrant, Chroma and
    PGVector refuse a vector of another dimension than their collection's)."""
    dimension, stored = len(vector), store_dimension(vectorstore)
    fix = (f"give a store made for dimension {dimension} (a new collection or table), or the embeddings it was "
           "built with")
    if stored is not None and stored != dimension:
        raise ValueError(f"the vector store ({type(vectorstore).__name__}) holds vectors of dimension {stored}, but "
                         f"the embeddings ({embedding_model}) make vectors of dimension {dimension}; {fix}")
    if stored is None and engine_of(vectorstore).checks_by_search:
        try:
            with answering(vectorstore, "search it before the first add"):
                vectorstore.similarity_search_by_vector(vector, k=1)
        except NotImplementedError:  # a store that cannot search by vector: its own add is the check
            return
        except ConnectionError:
            raise
        except Exception as err:
            raise ValueError(f"the vector store ({type(vectorstore).__name__}) refused a search with a vector of "
                             f"the embeddings ({embedding_model}, dimension {dimension}): {type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}; {fix}") from err


def check_vectorstore(directory: Path, manifest: dict[str, Any], vectorstore: VectorStore | None) -> None:
    """Refuse a vector store that is not the one the saved index was built into (or one for an index with its own
    FAISS files), or writes to another collection than the one its manifest records (an index that recorded none, a
    Chroma one saved before its collection was recorded, is checked by the chunks the store holds: check_holds)."""
    saved, given = manifest.get("vectorstore", DEFAULT_VECTORSTORE), vectorstore_name(vectorstore)
    saved_collection, collection = manifest.get("collection"), store_collection(vectorstore)
    if saved == given and manifest.get("count") and saved_collection is not None and saved_collection != collection:
        raise ValueError(f"the index in {directory} keeps its vectors in the collection {saved_collection!r} of its "
                         f"{type(vectorstore).__name__}, not in {collection!r}; open it with "
                         f"collection_name={saved_collection!r}, or ingest into a new index directory to use that one")
    if saved == given or (saved == DEFAULT_VECTORSTORE and not manifest.get("count")):
        return
    if saved == DEFAULT_VECTORSTORE:
        raise ValueError(f"the index in {directory} keeps its vectors in its own FAISS files, not in a {given}; open "
                         "it without a vector store, or ingest into a new index directory to use that store")
    if vectorstore is None:
        raise ValueError(f"the index in {directory} keeps its vectors in the vector store {saved}; open it with that "
                         "store (vectorstore=..., --vectorstore on the command line), as it was ingested")
    raise ValueError(f"the index in {directory} keeps its vectors in the vector store {saved}, not in a {given}; "
                     "open it with the store it was ingested into")


def check_holds(vectorstore: VectorStore, directory: Path, ids: dict[str, str]) -> None:
    """Refuse a vector store that lacks the saved index's chunks (a new, empty one), where it can look them up;
    `ids`: the chunks' ids in the store -> their own, in index order."""
    order = list(ids)
    sample = list(dict.fromkeys(order[:: max(1, len(order) // 8)] + order[-1:]))
    try:
        with answering(vectorstore, "look up the index's chunks"):
            found = {from_store(d).id for d in vectorstore.get_by_ids(sample)}
    except NotImplementedError:
        return
    missing = [i for i in sample if ids[i] not in found]
    if missing:
        raise ValueError(f"the vector store ({type(vectorstore).__name__}) lacks chunks of the index in {directory} "
                         f"({len(missing)} of {len(sample)} looked up, e.g. {missing[0]}); open the index with the "
                         "store (its collection, table or settings) it was ingested into")


__all__ = ["DEFAULT_VECTORSTORE", "EMBEDDING_ARGUMENTS", "VectorStoreSpec", "check_dimension", "check_holds",
           "check_vectorstore", "store_collection", "store_dimension", "store_embeddings", "vectorstore_name"]

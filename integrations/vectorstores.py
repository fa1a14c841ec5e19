"""The user's own vector store behind a NuggetIndex, named where no Python object can be passed: on the command line
(`--vectorstore MODULE:NAME --vectorstore-kwargs JSON`) and to Ray Serve replicas, which each build their own.

    VectorStoreSpec(target="langchain_chroma:Chroma", kwargs={"persist_directory": "chroma"}).build(embeddings)

`target` names a LangChain VectorStore class, or any function returning one (a factory of your own); it is called
with `kwargs` and the index's embeddings, under the name its signature takes them by (`embedding`, `embeddings` or
`embedding_function`). The module is imported because you named it: a saved index records only the store's class,
and is opened with the store named again.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore
from pydantic import BaseModel, ConfigDict, Field, field_validator

EMBEDDING_ARGUMENTS = ("embedding", "embeddings", "embedding_function")  # what LangChain's stores call them


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
        if not isinstance(store, VectorStore):
            raise ValueError(f"{self.target!r} made a {type(store).__name__}, not a LangChain VectorStore; name a "
                             "VectorStore class, or a function returning one")
        return store


__all__ = ["EMBEDDING_ARGUMENTS", "VectorStoreSpec"]

"""The retriever of a NuggetIndex: its vector store's, with `k` set once or per call, each chunk as the index wrote
it (its nugget record and id, as user_store.from_store reads them back from the user's store)."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.vectorstores import VectorStoreRetriever
from pydantic import Field, field_validator

from ..stores.user_store import from_store


class NuggetRetriever(VectorStoreRetriever):
    """The `k` chunks of a NuggetIndex most similar to a query: `k` set here, or per call (`invoke(query, k=2)`).

    `NuggetIndex.as_retriever` makes one; `NuggetRetriever(vectorstore=index.vectorstore, k=3)` too. The other
    search options go in `search_kwargs` (e.g. `fetch_k` with `search_type="mmr"`), as in VectorStoreRetriever.
    """

    k: int = Field(default=4, ge=1)

    @field_validator("search_kwargs")
    @classmethod
    def _no_k_in_search_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "k" in value:
            raise ValueError(f"search_kwargs={value!r} sets k: pass k={value['k']!r} to the retriever itself")
        return value

    def _search(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        k = kwargs.get("k", self.k)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k={k!r}: the number of chunks to retrieve must be an integer >= 1")
        return {**kwargs, "k": k}

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                **kwargs: Any) -> list[Document]:
        found = super()._get_relevant_documents(query, run_manager=run_manager, **self._search(kwargs))
        return [from_store(doc) for doc in found]

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       **kwargs: Any) -> list[Document]:
        found = await super()._aget_relevant_documents(query, run_manager=run_manager, **self._search(kwargs))
        return [from_store(doc) for doc in found]


__all__: list[str] = ["NuggetRetriever"]

"""The LCEL QA chain over a NuggetIndex (or any retriever): question -> chunks -> nuggets -> NuggetLLM; the one
assembly of the question's path (`answer_chain`: the command, the server, the Ray replicas); and the one-line labels
of the sources an answer names."""

from __future__ import annotations

from typing import Any

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda, RunnablePassthrough

from nugget_rag.components.compressor import METADATA_KEY, NuggetCompressor
from nugget_rag.components.llm import NuggetLLM
from nugget_rag.components.resolution import ResolutionPolicy, resolve_policy

from ..local.index import NuggetIndex


def build_qa_chain(
    index_or_retriever: NuggetIndex | BaseRetriever | Runnable,
    llm: NuggetLLM,
    k: int = 4,
    as_text: bool = False,
    resolution: ResolutionPolicy | type[ResolutionPolicy] | str | None = None,
) -> Runnable:
    """question -> retrieve -> nuggets -> NuggetLLM: ``{"documents": retriever | compressor, "question": q} | llm``.

    The compressor step passes the chunks that already name their stored state (a NuggetIndex's) as they are, and
    the llm reads each chunk's state once a question, by that key. Returns the AIMessage (its
    ``response_metadata["sources"]`` names the chunks read, ``["resolution"]`` how each retrieved chunk was read
    and why), or its text with ``as_text=True``. `k`: the chunks a NuggetIndex retrieves
    (the policy then reads some whole, may skim some and drops the rest). `resolution`: how each chunk is read, as
    NuggetLLM takes it (a policy or a name of RESOLUTIONS); None keeps the llm's own (by default "default").
    """
    if isinstance(index_or_retriever, NuggetIndex):
        return _reading_chain(index_or_retriever.as_retriever(k=k), llm, resolution, k, as_text)
    return _reading_chain(index_or_retriever, llm, resolution, None, as_text)


def answer_chain(index: NuggetIndex, k: int = 4, resolution: ResolutionPolicy | str = "default",
                 compressor: NuggetCompressor | None = None, retrieved: list[Document] | None = None,
                 **generation: Any) -> Runnable:
    """The question's path as `nugget-rag ask`, the server and its Ray replicas take it: a NuggetLLM over
    `compressor` (None: the index's) with `generation`'s settings (NuggetLLM's fields: max_new_tokens, batcher, ...),
    reading the `k` chunks `index` retrieves, or `retrieved` (the k chunks the caller has retrieved from it, under
    its own lock), by `resolution`. The chain's checks run for every caller."""
    llm = NuggetLLM(compressor=index.compressor if compressor is None else compressor, **generation)
    retriever = index.as_retriever(k=k) if retrieved is None else RunnableLambda(lambda _: retrieved)
    return _reading_chain(retriever, llm, resolution, k)


def _reading_chain(retriever: BaseRetriever | Runnable, llm: NuggetLLM,
                  resolution: ResolutionPolicy | type[ResolutionPolicy] | str | None, k: int | None,
                  as_text: bool = False) -> Runnable:
    """build_qa_chain's chain over `retriever`; `k`: the chunks it retrieves from a NuggetIndex (None: another
    retriever's), which a policy's `expand` must not exceed."""
    if resolution is not None:
        llm = llm.model_copy(update={"resolution": resolve_policy(resolution) if resolution != "default" else resolution})
    if isinstance(llm.resolution, ResolutionPolicy) and k is not None:
        if llm.resolution.expand > k:
            raise ValueError(f"{type(llm.resolution).__name__}(expand={llm.resolution.expand}) reads more chunks whole "
                             f"than k={k} retrieves; raise k to at least {llm.resolution.expand} or lower expand")
    # chunks that name their stored state (a NuggetIndex's) pass unread: the llm reads each state once, by its key
    compressor = llm.compressor.model_copy(update={"trust_metadata_keys": True})
    chain = {"documents": retriever | compressor, "question": RunnablePassthrough()} | llm
    return chain | StrOutputParser() if as_text else chain


def source_label(metadata: dict[str, Any]) -> str:
    """One line naming a source: its source/id/title and the chunk position."""
    meta = {k: v for k, v in metadata.items() if k != METADATA_KEY}
    parts = [str(meta.get("source") or meta.get("id") or "?")]
    if meta.get("id") and meta.get("id") != meta.get("source"):
        parts.append(f"id={meta['id']}")
    if meta.get("title"):
        parts.append(f"title={meta['title']!r}")
    if meta.get("start_index", -1) >= 0:
        parts.append(f"chars {meta['start_index']}+")
    return "  ".join(parts)


__all__: list[str] = ["answer_chain", "build_qa_chain", "source_label"]

"""The LCEL QA chain over a NuggetIndex (or any retriever): question -> chunks -> nuggets -> NuggetLLM, and the
one-line labels of the sources an answer names."""

from __future__ import annotations

from typing import Any

from langchain_core.output_parsers import StrOutputParser
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnablePassthrough

from nugget_rag.components.compressor import METADATA_KEY
from nugget_rag.components.llm import NuggetLLM
from nugget_rag.components.resolution import ResolutionPolicy, resolve_policy

from .index import NuggetIndex


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
        retriever = index_or_retriever.as_retriever(k=k)
    else:
        retriever = index_or_retriever
    if resolution is not None:
        llm = llm.model_copy(update={"resolution": resolve_policy(resolution) if resolution != "default" else resolution})
    if isinstance(llm.resolution, ResolutionPolicy) and isinstance(index_or_retriever, NuggetIndex):
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


__all__: list[str] = ["build_qa_chain", "source_label"]

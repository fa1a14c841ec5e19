"""The settings an index was built with, as its manifest records them (embeddings, nugget floor, chunking), taken on
by whatever opens it: a saved index (index.py's `NuggetIndex.load`) or one published in a store (published/index.py).
"""

from __future__ import annotations

from typing import Any

from langchain_core.embeddings import Embeddings

from nugget_rag.components.compressor import NuggetCompressor

from ..stores.embeddings import MINILM_NAME, embedding_name, minilm_embeddings
from ..stores.spec import store_embeddings

CHUNKING_DEFAULTS = (("chunk_tokens", 384), ("chunk_overlap", 32))  # what a manifest without them was built with


def built_settings(manifest: dict[str, Any], where: str, new_index: str, compressor: NuggetCompressor,
                   embeddings: Embeddings | None, kwargs: dict[str, Any]) -> tuple[NuggetCompressor, Embeddings]:
    """The compressor and embeddings that open the index `manifest` describes (`where`, e.g. "the index in DIR"),
    and its chunking and embedding model's name set in `kwargs` (NuggetIndex's keyword arguments).

    Embeddings: those given (or the user's vector store's), else MiniLM when the index was built with it. The
    compressor keeps nuggets down to the index's floor. A ValueError names a setting given that is not the index's,
    and the fix: open it with the index's, or ingest into `new_index` (e.g. "a new index directory").
    """
    embeddings = store_embeddings(kwargs.get("vectorstore"), embeddings)
    built_with = manifest.get("embedding_model")
    if embeddings is None:
        if built_with != MINILM_NAME:
            raise ValueError(f"{where} was built with embeddings {built_with!r}; pass the same model as embeddings=...")
        embeddings = minilm_embeddings()
    given = kwargs.pop("embedding_model", None) or embedding_name(embeddings)
    if given != built_with:
        raise ValueError(f"{where} was built with embeddings {built_with!r}, but {given!r} were given; load it with "
                         f"{built_with!r}, or ingest into {new_index} to use {given!r}")
    kwargs["embedding_model"] = given
    floor = manifest.get("keep_ratio", 1.0)  # an index keeps the floor it was built with
    if compressor.keep_ratio != floor:
        if "keep_ratio" in compressor.model_fields_set:
            raise ValueError(f"{where} keeps nuggets down to r = {floor:g}, not keep_ratio={compressor.keep_ratio:g}; "
                             f"open it with keep_ratio={floor:g}, or ingest into {new_index} for another floor")
        compressor = compressor.model_copy(update={"keep_ratio": floor})
    for name, default in CHUNKING_DEFAULTS:
        saved = manifest.get(name, default)
        if kwargs.setdefault(name, saved) != saved:
            raise ValueError(f"{where} was chunked with {name}={saved}, not {kwargs[name]}; load it with "
                             f"{name}={saved}, or ingest into {new_index}")
    return compressor, embeddings


__all__: list[str] = ["CHUNKING_DEFAULTS", "built_settings"]

"""Documents cut into token-aware chunks, each with a deterministic id and its place in its document."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

try:
    from langchain_text_splitters import RecursiveCharacterTextSplitter, TextSplitter
except ImportError as err:  # a core install: retrieval is an extra
    raise ImportError(f"{err.name} is not installed: nugget-rag's FAISS retrieval needs its [retrieval] extra "
                      "(pip install 'nugget-rag[retrieval]')") from err
from langchain_core.documents import Document
from transformers import PreTrainedTokenizerBase


def chunk_id(source: str, text: str) -> str:
    """Deterministic chunk id: the same text from the same source is indexed once."""
    return hashlib.sha256(f"{source}\0{text}".encode()).hexdigest()


def token_splitter(tokenizer: PreTrainedTokenizerBase, chunk_tokens: int, chunk_overlap: int) -> TextSplitter:
    """A splitter into chunks of at most `chunk_tokens` tokens of `tokenizer`, overlapping by `chunk_overlap`."""
    return RecursiveCharacterTextSplitter.from_huggingface_tokenizer(
        tokenizer, chunk_size=chunk_tokens, chunk_overlap=chunk_overlap,
    )


def split_documents(splitter: TextSplitter, documents: Sequence[Document]) -> list[Document]:
    """The chunks `splitter` cuts `documents` into, each with a deterministic id and `chunk`/`start_index` metadata.

    Every chunk names its document in `source`: the document's own `source`, else its id, else
    ``sha256:`` and the start of its text's digest.
    """
    chunks = []
    for doc in documents:
        source = str(doc.metadata.get("source") or doc.id or "")
        label = source or "sha256:" + hashlib.sha256(doc.page_content.encode()).hexdigest()[:16]
        start = 0
        for i, chunk in enumerate(splitter.split_documents([doc])):
            if not chunk.page_content.strip():
                continue
            # the splitter's own add_start_index mixes token overlap with character offsets: find it here
            found = doc.page_content.find(chunk.page_content, start)
            found = found if found >= 0 else doc.page_content.find(chunk.page_content)
            start = found + 1 if found >= 0 else start
            chunk.metadata.update(source=label, chunk=i, start_index=found)
            chunk.id = chunk_id(source, chunk.page_content)
            chunks.append(chunk)
    return chunks


__all__: list[str] = ["chunk_id", "split_documents", "token_splitter"]

"""Documents cut into token-aware chunks, each with a deterministic id and its place in its document."""

from __future__ import annotations

import hashlib
import threading
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


SEPARATORS = ["\n\n", "\n", " ", ""]  # RecursiveCharacterTextSplitter's: paragraphs, lines, words, characters
MEASURE_BATCH = 128  # pieces a tokenizer call measures: a fast tokenizer's time a piece grows in larger batches


class TokenSplitter(RecursiveCharacterTextSplitter):
    """RecursiveCharacterTextSplitter measuring pieces in tokens of `tokenizer`, as `from_huggingface_tokenizer`'s
    does, with the same chunks out: where that calls the tokenizer once a piece (about 140 calls for a passage of
    one chunk), this first measures every piece the split will try, a level at a time in batched calls."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chunk_tokens: int, chunk_overlap: int):
        super().__init__(separators=SEPARATORS, chunk_size=chunk_tokens, chunk_overlap=chunk_overlap,
                         length_function=self._length)
        self.tokenizer = tokenizer
        self.chunk_tokens = chunk_tokens
        self._local = threading.local()  # .tokens: the pieces of the text this thread splits -> their lengths

    def split_text(self, text: str) -> list[str]:
        self._local.tokens = {}
        try:
            self._foresee(text, SEPARATORS)
            return super().split_text(text)
        finally:
            del self._local.tokens

    def _foresee(self, text: str, separators: list[str]) -> None:
        """Measure the pieces the split cuts `text` into at the first of `separators` it holds, then those of each
        piece too long for a chunk at the next separators, as RecursiveCharacterTextSplitter recurses."""
        separator = next((s for s in separators if not s or s in text), separators[-1])
        pieces = split_keeping(text, separator) if separator else list(text)
        self._measure(["", *pieces], self._local.tokens)
        rest = separators[separators.index(separator) + 1 :] if separator else []
        for piece in dict.fromkeys(pieces):
            if rest and self._local.tokens[piece] >= self.chunk_tokens:
                self._foresee(piece, rest)

    def _length(self, piece: str) -> int:
        tokens = getattr(self._local, "tokens", {})  # outside split_text: measured, not kept
        if piece not in tokens:
            self._measure([piece], tokens)
        return tokens[piece]

    def _measure(self, pieces: list[str], tokens: dict[str, int]) -> None:
        new = list(dict.fromkeys(p for p in pieces if p not in tokens))
        for start in range(0, len(new), MEASURE_BATCH):
            batch = new[start : start + MEASURE_BATCH]
            tokens.update(zip(batch, map(len, self.tokenizer(batch, add_special_tokens=False)["input_ids"])))


def split_keeping(text: str, separator: str) -> list[str]:
    """The non-empty pieces of `text` cut at `separator`, each separator kept at the start of the piece after it."""
    first, *rest = text.split(separator)
    return [piece for piece in [first, *(separator + part for part in rest)] if piece]


def token_splitter(tokenizer: PreTrainedTokenizerBase, chunk_tokens: int, chunk_overlap: int) -> TextSplitter:
    """A splitter into chunks of at most `chunk_tokens` tokens of `tokenizer`, overlapping by `chunk_overlap`."""
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"the tokenizer is a {type(tokenizer).__name__}; give a transformers tokenizer")
    return TokenSplitter(tokenizer, chunk_tokens, chunk_overlap)


def chunk_start(text: str, chunk: str, start: int, end: int) -> int:
    """Where `chunk` begins in `text`: the first place from `start` (past the previous chunk's start) where it
    reaches beyond `end` (the previous chunk's end: each chunk adds text, so "0000" then "0" in "00000" is the
    fifth "0", not the second), else the first from `start`, else anywhere; -1 if it is not in `text`."""
    found = text.find(chunk, start)
    while found >= 0 and found + len(chunk) <= end:
        found = text.find(chunk, found + 1)
    if found < 0:
        found = text.find(chunk, start)
    return found if found >= 0 else text.find(chunk)


def split_documents(splitter: TextSplitter, documents: Sequence[Document]) -> list[Document]:
    """The chunks `splitter` cuts `documents` into, each with a deterministic id and `chunk`/`start_index` metadata.

    Every chunk names its document in `source`: the document's own `source`, else its id, else
    ``sha256:`` and the start of its text's digest.
    """
    chunks = []
    for doc in documents:
        source = str(doc.metadata.get("source") or doc.id or "")
        label = source or "sha256:" + hashlib.sha256(doc.page_content.encode()).hexdigest()[:16]
        start = end = 0
        for i, chunk in enumerate(splitter.split_documents([doc])):
            if not chunk.page_content.strip():
                continue
            # the splitter's own add_start_index mixes token overlap with character offsets: find it here
            found = chunk_start(doc.page_content, chunk.page_content, start, end)
            start, end = (found + 1, found + len(chunk.page_content)) if found >= 0 else (start, end)
            chunk.metadata.update(source=label, chunk=i, start_index=found)
            chunk.id = chunk_id(source, chunk.page_content)
            chunks.append(chunk)
    return chunks


__all__: list[str] = ["TokenSplitter", "chunk_id", "split_documents", "token_splitter"]

"""NuggetCompressor: LangChain documents in, documents naming their cached nuggets out."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, NamedTuple

import torch
from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from langchain_core.stores import BaseStore
from pydantic import ConfigDict, Field, field_validator
from tqdm.auto import tqdm

from .checkpoint_files import DEFAULT_CHECKPOINT
from .config import NuggetConfig
from .model import NuggetModel
from .state import KVFormat, NuggetState
from .store import NuggetStore

log = logging.getLogger(__name__)

METADATA_KEY = "nuggets"
# The states of a `batch` call's one compression pass, by text, for the per-input runs it then makes.
_BATCH_STATES: ContextVar[tuple[str, dict[str, NuggetState]]] = ContextVar("nugget_batch_states", default=("", {}))
CompressorInput = str | Document | Sequence[str | Document]


def as_documents(value: Any) -> list[Document]:
    """Documents from a Document, a string, or a sequence of them; other types get a TypeError naming them."""
    items = [value] if isinstance(value, (str, Document)) else value
    if not isinstance(items, Sequence):
        raise TypeError(f"expected a Document, a string or a list of them, got {type(value).__name__}")
    docs = []
    for i, item in enumerate(items):
        if isinstance(item, Document):
            docs.append(item)
        elif isinstance(item, str):
            docs.append(Document(page_content=item))
        else:
            raise TypeError(f"item {i} is a {type(item).__name__}; give Documents or strings")
    return docs


class Compressed(NamedTuple):
    """One document's nuggets: their store key, the state, and whether it came from the cache."""

    key: str
    state: NuggetState
    cached: bool


class NuggetCompressor(BaseDocumentCompressor, RunnableSerializable[CompressorInput, list[Document]]):
    """Compresses documents into nuggets (paper Sec. 2.3), caching each in a content-addressed store.

    Input: a Document, a string, or a list of them. Output: new Documents with the same text and metadata plus
    ``metadata["nuggets"] = {"key", "n_tokens", "n_nuggets", "ratio"}`` (JSON), where ``key`` addresses the
    NuggetState in `store`. Empty or whitespace-only documents are dropped, with a warning.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: NuggetModel
    store: NuggetStore = Field(default_factory=NuggetStore)
    ratio: float | None = Field(None, description="Compression ratio r; default: the model's.")
    batch_size: int = Field(8, ge=1, description="Documents compressed in one forward pass.")
    segment_tokens: int | None = Field(None, ge=1, description="Longer documents are split (default: model positions).")
    kv_format: KVFormat = Field("bfloat16", description="How nugget keys/values are kept and stored: bfloat16 (half "
                                "of float32's bytes), float16, float32, int8 (a quarter; keys per channel, values per "
                                "token) or int4 (an eighth). A state stored in another format is read as it is.")
    show_progress: bool = False

    @field_validator("ratio", mode="before")
    @classmethod
    def _check_ratio(cls, value: object) -> float | None:
        return None if value is None else NuggetConfig(ratio=value).ratio

    @field_validator("store", mode="before")
    @classmethod
    def _check_store(cls, value: object) -> NuggetStore:
        if isinstance(value, BaseStore):  # a ByteStore (BaseStore[str, bytes]; generics allow no isinstance)
            return NuggetStore(byte_store=value)
        if not isinstance(value, NuggetStore):
            raise TypeError(f"store is a {type(value).__name__}; give a NuggetStore or a LangChain ByteStore "
                            "(e.g. RedisStore), or store_dir=PATH to from_pretrained")
        return value

    @classmethod
    def from_pretrained(
        cls,
        checkpoint: str | Path | None = DEFAULT_CHECKPOINT,
        base_model: str | Path | None = None,
        store_dir: str | Path | None = None,
        device: str | None = None,
        dtype: str | None = None,
        **fields: Any,
    ) -> NuggetCompressor:
        """Load a nugget checkpoint; `fields` are the compressor's own (`store`, `ratio`, `batch_size`, ...).

        Default checkpoint: the one shipped for SmolLM2-135M-Instruct (MODEL_CARD.md); None: untrained adapters.
        The store is `store` (a NuggetStore, or a ByteStore such as RedisStore that it wraps), else a directory
        store in `store_dir`, else memory.
        """
        if store_dir is not None and fields.get("store") is not None:
            raise ValueError(f"got both store={fields['store']!r} and store_dir={str(store_dir)!r}; pass one")
        if store_dir is not None:
            fields["store"] = NuggetStore(directory=store_dir)
        model = NuggetModel.from_pretrained(checkpoint, base_model=base_model, device=device, dtype=dtype)
        return cls(model=model, **fields)

    @property
    def effective_ratio(self) -> float:
        return self.ratio or self.model.config.ratio

    @property
    def fingerprint(self) -> str:
        """What names this compressor's states in the store (`NuggetModel.fingerprint`)."""
        return self.model.fingerprint(self.effective_ratio, segment_tokens=self.segment_tokens)

    # ------------------------------------------------------------------ core
    def states(self, documents: Sequence[Document | str]) -> list[NuggetState]:
        """The NuggetState of each document: from the store when cached, else computed and stored."""
        return [found.state for found in self.lookup(documents)]

    def lookup(self, documents: Sequence[Document | str]) -> list[Compressed]:
        """Each document's key, state and whether the state was cached (else it is computed and stored now)."""
        docs = as_documents(documents)
        fingerprint = self.fingerprint
        texts = [d.page_content for d in docs]
        found: dict[str, NuggetState] = {}
        missing = []
        batch_fingerprint, ready = _BATCH_STATES.get()
        ready = ready if batch_fingerprint == fingerprint else {}
        for text in dict.fromkeys(texts):
            state = ready.get(text) or self.store.get(text, fingerprint)
            if state is None:
                missing.append(text)
            else:
                found[text] = state
        tokenized = {text: self.model.tokenizer(text, add_special_tokens=False)["input_ids"] for text in missing}
        missing.sort(key=lambda text: len(tokenized[text]))  # similar lengths share a batch: less padding
        batches = range(0, len(missing), self.batch_size)
        for start in tqdm(batches, desc="compressing", unit="batch", disable=not self.show_progress or not missing):
            chunk = missing[start : start + self.batch_size]
            with torch.inference_mode():
                states = self.model.compress(
                    [tokenized[t] for t in chunk], ratio=self.effective_ratio, segment_tokens=self.segment_tokens
                )
            for text, state in zip(chunk, states):
                found[text] = state.compact(self.kv_format)  # as it will be read back from the store
                self.store.put(text, found[text])
        computed = set(missing)
        return [Compressed(self.store.key(t, fingerprint), found[t], t not in computed) for t in texts]

    def compress(self, documents: Sequence[Document]) -> list[Document]:
        """New Documents whose metadata names their stored nuggets; the inputs are left untouched."""
        kept = []
        for i, doc in enumerate(documents):
            if doc.page_content.strip():
                kept.append(doc)
            else:
                log.warning("document %d (id=%r) is empty or whitespace; it has no nuggets and is dropped", i, doc.id)
        out = []
        for doc, (key, state, _) in zip(kept, self.lookup(kept)):
            meta = {k: v for k, v in doc.metadata.items() if k != METADATA_KEY}
            meta[METADATA_KEY] = {"key": key, "n_tokens": state.n, "n_nuggets": state.k, "ratio": self.effective_ratio}
            out.append(Document(page_content=doc.page_content, metadata=meta, id=doc.id))
        return out

    # ------------------------------------------------------------------ LangChain interfaces
    def invoke(self, input: CompressorInput, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        return self._call_with_config(lambda value: self.compress(as_documents(value)), input, config, run_type="tool")

    def batch(
        self,
        inputs: list[CompressorInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[list[Document] | Exception]:
        """Runnable.batch (one run per input, with its config), after compressing all valid inputs' documents
        together (batched passes over the model); each run takes its states from that pass, not the store, whose
        memory may have evicted them meanwhile."""
        docs = []
        for value in inputs:
            try:
                docs += as_documents(value)
            except TypeError:
                if not return_exceptions:
                    raise
        texts = [d.page_content for d in docs if d.page_content.strip()]
        token = _BATCH_STATES.set((self.fingerprint, dict(zip(texts, self.states(texts)))))
        try:
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        finally:
            _BATCH_STATES.reset(token)

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        """BaseDocumentCompressor: the query does not change the nuggets (they are reused by every question)."""
        return self.invoke(list(documents), {"callbacks": callbacks})

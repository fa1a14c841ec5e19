"""NuggetCompressor: LangChain documents in, documents naming their cached nuggets out."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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

from ..cancellation import check
from ..config import DECODER, ENCODER, PROBE_RATIO, NuggetConfig
from ..model.checkpoint_files import DEFAULT_CHECKPOINT
from ..model.nugget_model import NuggetModel
from ..state.nugget_state import KVFormat, NuggetState
from ..state.store import NuggetStore

log = logging.getLogger(__name__)

METADATA_KEY = "nuggets"
NUGGET_FIELDS = ("key", "n_tokens", "n_nuggets", "ratio", "floor")  # what `compress` writes under METADATA_KEY
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
    """One document's nuggets: the key of the stored state they were read from, the state at the ratio asked for
    (reading order), whether it came from the cache, and the stored state itself."""

    key: str
    state: NuggetState
    cached: bool
    stored: NuggetState


class StatesRead:
    """What one reading took from a store (`NuggetCompressor.reading`): each state read or computed, by key, with
    whether the store held it, and the key each document's metadata names, by text."""

    def __init__(self, store: NuggetStore):
        self.store = store
        self.states: dict[str, tuple[NuggetState, bool]] = {}
        self.named: dict[str, str] = {}

    def name(self, documents: Sequence[Document]) -> None:
        for doc in documents:
            info = doc.metadata.get(METADATA_KEY)
            if isinstance(info, dict) and isinstance(info.get("key"), str):
                self.named[doc.page_content] = info["key"]


_READING: ContextVar[StatesRead | None] = ContextVar("nugget_reading", default=None)


class NuggetCompressor(BaseDocumentCompressor, RunnableSerializable[CompressorInput, list[Document]]):
    """Compresses documents into nuggets (paper Sec. 2.3), caching each in a content-addressed store.

    Input: a Document, a string, or a list of them. Output: new Documents with the same text and metadata plus
    ``metadata["nuggets"] = {"key", "n_tokens", "n_nuggets", "ratio", "floor"}`` (JSON), where ``key`` addresses
    the NuggetState in `store`. Empty or whitespace-only documents are dropped, with a warning.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: NuggetModel
    store: NuggetStore = Field(default_factory=NuggetStore)
    ratio: float | None = Field(None, description="Compression ratio r a document is read at unless a call asks for "
                                "another; default: the model's.")
    keep_ratio: float = Field(PROBE_RATIO, description="The finest ratio stored (each state's floor): a document "
                              "is compressed once, its nuggets kept in resolution order down to this ratio, and read "
                              "at any ratio >= keep_ratio without recompute. Default: what the default policy reads "
                              "(its probe at r = 4; a passage it reads whole is read from its text state). 1 keeps "
                              "every position (23 KB a token in bfloat16, 6 KB in int4); a finer ratio asked for is "
                              "compressed and stored anew.")
    batch_size: int = Field(8, ge=1, description="Documents compressed in one forward pass.")
    segment_tokens: int | None = Field(None, ge=1, description="Longer documents are split (default: model positions).")
    kv_format: KVFormat = Field("bfloat16", description="How nugget keys/values are kept and stored: bfloat16 (half "
                                "of float32's bytes), float16, float32, int8 (a quarter; keys per channel, values per "
                                "token) or int4 (an eighth). A state stored in another format is read as it is.")
    text_states: bool = Field(False, description="Also store each document as the frozen model reads its text "
                              "(r = 1, adapters off): what a resolution policy reads a document whole from, so that "
                              "no question waits for it (twice the store's bytes at keep_ratio 1).")
    trust_metadata_keys: bool = Field(False, description="Pass a document whose metadata already names this "
                                      "compressor's stored state of its text at its ratio (a chunk retrieved from a "
                                      "NuggetIndex) as it is, its state unread: the QA chain's step, after which "
                                      "NuggetLLM reads the state by that key (and recomputes one the store lost). "
                                      "Off: every document's state is made sure of in the store (ingest).")
    show_progress: bool = False

    @field_validator("ratio", mode="before")
    @classmethod
    def _check_ratio(cls, value: object) -> float | None:
        return None if value is None else NuggetConfig(ratio=value).ratio

    @field_validator("keep_ratio", mode="before")
    @classmethod
    def _check_keep_ratio(cls, value: object) -> float:
        return NuggetConfig(ratio=value).ratio

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
        """What names this compressor's states in the store (`NuggetModel.fingerprint` of a ranked state at the
        floor `keep_ratio`)."""
        return self.stored_fingerprint(self.keep_ratio)

    def stored_fingerprint(self, floor: float, adapter: str | None = ENCODER) -> str:
        """The fingerprint of a ranked state with `floor`, made by `adapter` (None: the frozen model, whose states
        read at r = 1 are the document as its text is read)."""
        return self.model.fingerprint(floor, adapter, segment_tokens=self.segment_tokens, ranked=True)

    # ------------------------------------------------------------------ core
    def states(self, documents: Sequence[Document | str], ratios: float | Sequence[float] | None = None,
               adapter: str | None = ENCODER) -> list[NuggetState]:
        """The NuggetState of each document read at its ratio (default `ratio`): from the store when cached, else
        computed and stored."""
        return [found.state for found in self.lookup(documents, ratios, adapter)]

    def lookup(self, documents: Sequence[Document | str], ratios: float | Sequence[float] | None = None,
               adapter: str | None = ENCODER) -> list[Compressed]:
        """Each document read at its ratio (one for all, or one each; default `ratio`), with the key of the stored
        state it was read from and whether that state was cached (else it is computed and stored now).

        A stored state serves every ratio at or above its floor. A ratio below `keep_ratio` is compressed at that
        ratio and stored as well, never read short; states stored in reading order by earlier versions are read at
        the one ratio they were made at. `adapter` makes the states (None: the frozen model).
        """
        docs = as_documents(documents)
        texts = [d.page_content for d in docs]
        wanted = self._ratios(ratios, len(texts))
        with self.reading(docs) as read:
            found: dict[tuple[str, float], tuple[str, NuggetState, bool]] = {}  # (text, ratio) -> key, stored, cached
            missing: dict[float, list[str]] = {}  # floor -> texts to compress there
            for text, ratio in dict.fromkeys(zip(texts, wanted)):
                hit = self._find(text, ratio, adapter, read)
                if hit is None:
                    missing.setdefault(min(self.keep_ratio, ratio), []).append(text)
                else:
                    found[text, ratio] = hit
            computed = {floor: self._compress(list(dict.fromkeys(group)), floor, adapter)
                        for floor, group in missing.items()}
            for text, state in (item for states in computed.values() for item in states.items()):
                read.states[self.store.key(text, state.fingerprint)] = (state, False)
        out = []
        for text, ratio in zip(texts, wanted):
            if (text, ratio) not in found:
                state = computed[min(self.keep_ratio, ratio)][text]
                found[text, ratio] = (self.store.key(text, state.fingerprint), state, False)
            key, stored, cached = found[text, ratio]
            out.append(Compressed(key, stored.at_ratio(ratio) if stored.ranked else stored, cached, stored))
        return out

    @contextmanager
    def reading(self, documents: Sequence[Document | str] = ()) -> Iterator[StatesRead]:
        """A block in which each stored state is read from the store once (one question's answer, one `batch`
        call): a later lookup of it in the block takes it from there. A document whose metadata names its state's
        key (this compressor's output) is read by that key first. Blocks over one store nest into the outer one."""
        outer = _READING.get()
        read = outer if outer is not None and outer.store is self.store else StatesRead(self.store)
        read.name(as_documents(documents))
        if read is outer:
            yield read
            return
        token = _READING.set(read)
        try:
            yield read
        finally:
            _READING.reset(token)

    def _ratios(self, ratios: float | Sequence[float] | None, count: int) -> list[float]:
        if ratios is None or isinstance(ratios, (int, float)):
            ratios = [self.effective_ratio if ratios is None else ratios] * count
        ratios = list(ratios)
        if len(ratios) != count:
            raise ValueError(f"got {len(ratios)} ratios for {count} documents; give one ratio, or one per document")
        return [NuggetConfig(ratio=r).ratio for r in ratios]

    def _find(self, text: str, ratio: float, adapter: str | None,
              read: StatesRead) -> tuple[str, NuggetState, bool] | None:
        """A cached state that can be read at `ratio`, its key and whether the store held it: ranked at the floor,
        ranked at `ratio` (stored when that ratio was asked below the floor), or in reading order at `ratio`
        (stored by an earlier version); the one the document's metadata names first, each read once a block."""
        floors = [self.keep_ratio] if self.keep_ratio <= ratio else [ratio]
        fingerprints = [self.stored_fingerprint(f, adapter) for f in floors]
        fingerprints.append(self.model.fingerprint(ratio, adapter, segment_tokens=self.segment_tokens))
        keys = {self.store.key(text, fingerprint): fingerprint for fingerprint in fingerprints}
        for key in sorted(keys, key=lambda key: key != read.named.get(text)):
            if key not in read.states:
                state = self.store.get(text, keys[key])
                if state is None:
                    continue
                read.states[key] = (state, True)
            return key, *read.states[key]
        return None

    def _compress(self, texts: list[str], floor: float, adapter: str | None) -> dict[str, NuggetState]:
        """Compress `texts` into ranked states with `floor`, store them and return them by text; inside a
        `cancellable` block (cancellation.py), each batch first checks it."""
        tokenized = {text: self.model.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts}
        texts = sorted(texts, key=lambda text: len(tokenized[text]))  # similar lengths share a batch: less padding
        out = {}
        batches = range(0, len(texts), self.batch_size)
        for start in tqdm(batches, desc="compressing", unit="batch", disable=not self.show_progress or not texts):
            check()  # a cancelled request stops here: every state stored so far is whole
            chunk = texts[start : start + self.batch_size]
            with torch.inference_mode():
                states = self.model.compress([tokenized[t] for t in chunk], ratio=floor, adapter=adapter,
                                             segment_tokens=self.segment_tokens, ranked=True)
            for text, state in zip(chunk, states):
                out[text] = state.compact(self.kv_format)  # as it will be read back from the store
                self.store.put(text, out[text])
        return out

    def compress(self, documents: Sequence[Document]) -> list[Document]:
        """New Documents whose metadata names their stored nuggets; the inputs are left untouched. With
        `trust_metadata_keys`, a document already naming them keeps its metadata, unread."""
        kept = []
        for i, doc in enumerate(documents):
            if doc.page_content.strip():
                kept.append(doc)
            else:
                log.warning("document %d (id=%r) is empty or whitespace; it has no nuggets and is dropped", i, doc.id)
        passes = self._passing(kept)
        todo = [doc for doc, passed in zip(kept, passes) if not passed]
        if self.text_states and todo:
            self.lookup(todo, 1.0, adapter=None)
        found = iter(self.lookup(todo))
        out = []
        for doc, passed in zip(kept, passes):
            meta = {k: v for k, v in doc.metadata.items() if k != METADATA_KEY}
            if passed:
                meta[METADATA_KEY] = dict(doc.metadata[METADATA_KEY])
            else:
                key, state, _, stored = next(found)
                meta[METADATA_KEY] = {"key": key, "n_tokens": state.n, "n_nuggets": state.k,
                                      "ratio": self.effective_ratio, "floor": stored.floor}
            out.append(Document(page_content=doc.page_content, metadata=meta, id=doc.id))
        return out

    def named_states(self, documents: Sequence[Document]) -> list[dict | None]:
        """The nugget metadata each document carries when it names this compressor's stored state of its text (the
        key of its state at the floor `keep_ratio`, as `compress` wrote it), else None."""
        fingerprint = self.fingerprint
        named = []
        for doc in documents:
            info = doc.metadata.get(METADATA_KEY)
            names = (isinstance(info, dict) and all(field in info for field in NUGGET_FIELDS)
                     and info["key"] == self.store.key(doc.page_content, fingerprint))
            named.append(info if names else None)
        return named

    def _passing(self, documents: Sequence[Document]) -> list[bool]:
        """Which documents `compress` passes as they are (`trust_metadata_keys`, and they name their state)."""
        if not self.trust_metadata_keys:
            return [False] * len(documents)
        return [info is not None and info["ratio"] == self.effective_ratio for info in self.named_states(documents)]

    def token_counts(self, documents: Sequence[Document | str]) -> list[int]:
        """Each document's length in tokens: as the metadata naming its state says (`named_states`), else tokenised
        (all the others in one call)."""
        docs = as_documents(documents)
        known = [(info or {}).get("n_tokens") for info in self.named_states(docs)]
        unknown = [doc.page_content for doc, count in zip(docs, known) if not isinstance(count, int)]
        measured = iter(self.model.tokenizer(unknown, add_special_tokens=False)["input_ids"] if unknown else [])
        return [count if isinstance(count, int) else len(next(measured)) for count in known]

    def question_likelihoods(self, states: Sequence[NuggetState], instruction: str, question: str,
                             adapter: str | None, batch: int) -> list[float]:
        """The question-likelihood probe (resolution.QueryLikelihood): the mean log-probability of the `question`'s
        tokens after each state and a user turn of `instruction`, read by the decoder (the frozen model for states
        of no `adapter`), `batch` states a forward pass; a cancelled request stops between passes."""
        _, after = self.model.chat_prompt([{"role": "user", "content": instruction}])
        asked = self.model.tokenizer(question, add_special_tokens=False)["input_ids"]
        if not asked:
            raise ValueError("QueryLikelihood needs a question to score the documents with; got an empty one")
        scores = []
        for start in range(0, len(states), batch):
            check()
            scores += self._likelihood(states[start : start + batch], after, asked, adapter)
        return scores

    def _likelihood(self, states: Sequence[NuggetState], after: list[int], asked: list[int],
                    adapter: str | None) -> list[float]:
        """The mean log-probability of the `asked` tokens after each state and the `after` prompt: one pass."""
        model = self.model
        ids = torch.tensor([after + asked] * len(states), device=model.device)
        labels = torch.full_like(ids, -100)
        labels[:, len(after) :] = ids[:, len(after) :]
        with torch.inference_mode():
            out = model.decode([[s] for s in states], ids, labels=labels, return_logits=False,
                               adapter=None if adapter is None else DECODER)
        logp = torch.log_softmax(out.target_logits, dim=-1).view(len(states), len(asked), -1)
        target = torch.tensor(asked, device=logp.device)[None, :, None].expand(len(states), -1, 1)
        return logp.gather(-1, target).squeeze(-1).mean(-1).tolist()

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
        together (batched passes over the model); each run takes its states from that pass (one `reading`), not
        the store, whose memory may have evicted them meanwhile."""
        docs = []
        for value in inputs:
            try:
                docs += as_documents(value)
            except TypeError:
                if not return_exceptions:
                    raise
        kept = [d for d in docs if d.page_content.strip()]
        todo = [d for d, passed in zip(kept, self._passing(kept)) if not passed]
        with self.reading(docs):
            if self.text_states and todo:
                self.lookup(todo, 1.0, adapter=None)
            self.lookup(todo)
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        """BaseDocumentCompressor: the query does not change the nuggets (they are reused by every question)."""
        return self.invoke(list(documents), {"callbacks": callbacks})

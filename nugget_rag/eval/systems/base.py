"""The one interface every compared system implements, and the registry that names them.

A system turns an example's documents into what the decoder reads (`Reading`): either key/value states put
before the prompt (`NuggetState`s, read by `NuggetModel.decode`/`generate` with any adapter or none), or texts
put in the prompt (Full's template, `prompts.full_context_messages`), or, for a peer package that runs its own
generation, the answer itself. The runner builds every prompt with `prompt_ids`, so all systems share one
prompt format, one decoder and one scoring code path.

Adding a system is one file in this folder:

    @register("my_system")
    class MySystem(System):
        label = "My system (re-impl.)"
        def prepare(self, env, queries, ratio):
            return [Reading(texts=[...], adapter=None) for q in queries]
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from ...config import PROBE_RATIO
from ...prompts import chat_token_ids, full_context_messages
from ...state.nugget_state import NuggetState

if TYPE_CHECKING:
    from ...model.nugget_model import NuggetModel

Kind = Literal["qa", "summarization", "autoencoding", "lm"]
ALL_KINDS: frozenset[str] = frozenset({"qa", "summarization", "autoencoding", "lm"})


@dataclass
class Query:
    """One example as a system sees it.

    documents / document_ids: the texts to compress (HotpotQA: 10 paragraphs, compressed one by one) and their
    token ids (the model's tokenizer, no special tokens). instruction: the rendered task instruction (QA prompt
    with the question, summary prompt, repeat prompt); empty for language modelling. context_ids / target_ids
    (language modelling only): the uncompressed recent tokens after the history, and the tokens scored.
    max_new_tokens: the generation budget of the task (greedy). question: the question alone (QA). gold: which
    documents hold the answer, where the task knows (RAG tasks; the oracle's choice).
    """

    kind: str
    documents: list[str]
    document_ids: list[list[int]]
    instruction: str = ""
    context_ids: list[int] = field(default_factory=list)
    target_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 64
    question: str = ""
    gold: list[int] = field(default_factory=list)


@dataclass
class Reading:
    """What the decoder reads for one example.

    Exactly one of: `states` (KV prefix, one or more per document), `texts` (document texts in the prompt; [] =
    no document), `answer` (a peer generated the output itself). `text_ids` may give the texts' exact token ids
    (language modelling reads token ids, not re-tokenised text). `adapter` decodes (None: the frozen base
    model); `soft_prompt` puts the trained soft token before an empty prompt (nugget autoencoding); `model`
    replaces the run's model (Full fine-tuned); `info` holds per-example notes that the report aggregates.
    """

    states: list[NuggetState] | None = None
    texts: list[str] | None = None
    text_ids: list[list[int]] | None = None
    answer: str | None = None
    adapter: str | None = None
    soft_prompt: bool = False
    model: NuggetModel | None = None
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        given = sum(x is not None for x in (self.states, self.texts, self.answer))
        if given != 1:
            raise ValueError("a Reading holds exactly one of states, texts or answer")


@dataclass
class Skipped:
    """An example this system cannot run (counted by reason in the report, never silently dropped)."""

    reason: str


@dataclass
class Env:
    """What systems may use: the run's model, the optional full-context fine-tuned model, a per-run cache."""

    model: NuggetModel
    full_model: NuggetModel | None = None
    base_model_path: str | None = None  # a directory a peer package can load the same base model from
    peer_python: str | None = None  # the interpreter of the peers' virtual environment
    batch_size: int = 4
    keep_ratio: float = PROBE_RATIO  # the store floor of compressors the systems build (NuggetCompressor.keep_ratio)
    threads: int | None = None
    show_progress: bool = False
    cache: dict = field(default_factory=dict)

    def cache_for(self, name: str) -> dict:
        return self.cache.setdefault(name, {})


class System:
    """Base class: subclasses set `label` and implement `prepare`.

    `uses_ratio` False: the system does not compress (Full, NoDoc) and runs once per task, reported as r = 1 or
    no document. `kinds`: the task kinds it supports (others are reported as n/a). `reimplementation`: True for
    a re-implementation of a peer method (its label says so). `reference`: results that are not comparable as
    a cached compressor (query-aware selection cannot be cached across questions). `in_default`: False for a
    variant that runs only when named (not in "all systems").
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    uses_ratio: ClassVar[bool] = True
    kinds: ClassVar[frozenset[str]] = ALL_KINDS
    reimplementation: ClassVar[bool] = False
    reference: ClassVar[bool] = False
    description: ClassVar[str] = ""
    in_default: ClassVar[bool] = True

    def available(self, env: Env) -> str | None:
        """None when the system can run here, else the reason it cannot (reported, the run goes on)."""
        return None

    def prepare(self, env: Env, queries: Sequence[Query], ratio: float | None) -> list[Reading | Skipped]:
        raise NotImplementedError

    def close(self) -> None:
        """Release outside resources (a peer process)."""


class Reimplementation(System):
    """A peer method re-implemented here: its description is its module docstring's second paragraph."""

    reimplementation = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.description = sys.modules[cls.__module__].__doc__.split("\n\n")[1].replace("\n", " ")


SYSTEMS: dict[str, type[System]] = {}


def register(name: str):
    """Class decorator: make a System available to the harness under `name`."""

    def wrap(cls: type[System]) -> type[System]:
        if name in SYSTEMS and SYSTEMS[name] is not cls:
            raise ValueError(f"a system named {name!r} is already registered ({SYSTEMS[name].__name__})")
        if not cls.label:
            raise ValueError(f"system {name!r} needs a label")
        cls.name = name
        SYSTEMS[name] = cls
        return cls

    return wrap


def get_system(name: str) -> System:
    try:
        return SYSTEMS[name]()
    except KeyError:
        raise ValueError(f"unknown system {name!r}; registered: {', '.join(sorted(SYSTEMS))}") from None


# ------------------------------------------------------------------ shared helpers
def budget(n_tokens: int, ratio: float) -> int:
    """Slots a document of n tokens may keep at ratio r: k = ceil(n / r), the nuggets' own budget."""
    from ...config import nugget_count

    if n_tokens < 1:
        raise ValueError("an empty document has no tokens to keep")
    return nugget_count(n_tokens, ratio)


def per_document(env: Env, queries: Sequence[Query], cache_name: str,
                 compute: Callable[[list[tuple[int, ...]]], Sequence]) -> list[list | None]:
    """Each query's per-document results of `compute`, or None where a query has an empty document.

    `compute` maps a batch of distinct documents (token-id tuples, shortest first, `env.batch_size` at most) to
    one result each; results are kept in the run's cache under `cache_name`, so a document shared by several
    queries is processed once.
    """
    cache = env.cache_for(cache_name)
    todo = sorted({tuple(ids) for q in queries for ids in q.document_ids if ids and tuple(ids) not in cache}, key=len)
    for start in range(0, len(todo), env.batch_size):
        chunk = todo[start : start + env.batch_size]
        cache.update(zip(chunk, compute(chunk), strict=True))
    return [None if any(len(ids) == 0 for ids in q.document_ids) else [cache[tuple(ids)] for ids in q.document_ids]
            for q in queries]


def document_readings(env: Env, queries: Sequence[Query], cache_name: str,
                      compute: Callable[[list[tuple[int, ...]]], Sequence],
                      reading: Callable[[Query, list], Reading]) -> list[Reading | Skipped]:
    """`per_document`'s results, each query's read as `reading(query, results)`; a query with an empty document
    is skipped, saying so."""
    return [Skipped("empty document") if results is None else reading(q, results)
            for q, results in zip(queries, per_document(env, queries, cache_name, compute))]


def as_text(env: Env, kept: list[list[int]]) -> Reading:
    """Kept token ids read as text in Full's prompt."""
    return Reading(texts=[env.model.tokenizer.decode(ids) for ids in kept], text_ids=kept)


def kept_text(env: Env, queries: Sequence[Query], keep: Callable[[list[int], Query], list[int]]) -> list[Reading | Skipped]:
    """Each query's documents cut to the token ids `keep(ids, query)` chooses, read as text in Full's prompt."""
    return [Skipped("empty document") if any(len(ids) == 0 for ids in q.document_ids)
            else as_text(env, [keep(list(ids), q) for ids in q.document_ids]) for q in queries]


def user_prompt(tokenizer, instruction: str) -> list[int]:
    return chat_token_ids(tokenizer, [{"role": "user", "content": instruction}])


def prompt_ids(model, query: Query, reading: Reading) -> tuple[list[int], list[int]]:
    """The token ids the decoder `model` reads before and after any KV states: one format for every system.

    qa / summarization / autoencoding: with states, Full's prompt with the states in the documents' place
    (`NuggetModel.chat_prompt`), or nothing after the soft prompt; with texts, Full's prompt (documents then
    instruction in one user turn, App. D); with no text, the instruction alone (NoDoc). Language modelling:
    [history as text or states][context][target], no template, after the document opening the states were
    encoded after (`NuggetModel.document_opening`; empty for before_prompt), for every system alike.
    Autoencoding states follow that opening too.
    """
    tokenizer = model.tokenizer
    if query.kind == "lm":
        head: list[int] = []
        if reading.texts is not None:
            ids = reading.text_ids or [tokenizer(t, add_special_tokens=False)["input_ids"] for t in reading.texts]
            head = [i for part in ids for i in part]
        return list(model.document_opening), head + list(query.context_ids) + list(query.target_ids)
    if reading.states is not None:
        if reading.soft_prompt:
            return list(model.document_opening), []
        return model.chat_prompt([{"role": "user", "content": query.instruction}])
    if reading.texts:
        return [], chat_token_ids(tokenizer, full_context_messages(reading.texts, query.instruction))
    return [], user_prompt(tokenizer, query.instruction)


def kept_slots(tokenizer, reading: Reading) -> int | None:
    """How many positions the documents take in what the decoder reads: KV slots or text tokens."""
    if reading.states is not None:
        return sum(s.k for s in reading.states)
    if reading.texts is not None:
        if reading.text_ids is not None:
            return sum(len(t) for t in reading.text_ids)
        return sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in reading.texts)
    return reading.info.get("kept_tokens")

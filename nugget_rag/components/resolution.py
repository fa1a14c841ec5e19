"""Per-document resolution: how finely each retrieved document is read for one question.

A stored state serves any ratio at or above its floor (NuggetState.at_ratio), so a chain can read the evidence
whole, skim the rest, or drop it, per question. A `ResolutionPolicy` ranks the documents by relevance: its top
`expand` documents (more when `expand_margin` finds the next ones about as relevant) are always read whole (r = 1),
the rest at `skim_ratio` within what a budget of positions leaves, or dropped when that is None. Each policy is
one small class that only scores relevance:

| policy | relevance |
|---|---|
| `RetrieverRank` | the order the documents came in (a retriever's ranking) |
| `LexicalRerank` | BM25 of the question against the documents (rank-bm25) |
| `QueryLikelihood` | log P(question | the document's nuggets at r = 4), read from the store by the decoder |
| `UniformResolution` | none: every document at one ratio (the compressor's unless given) |

A policy reaches the documents' states and the model only through the compressor's `PlanCompressor` surface.
`resolve_policy` turns a name (`RESOLUTIONS`: "default", "uniform", "rank", "lexical", "likelihood"), a class or a
policy into a policy: the one resolver the chain, NuggetLLM, the CLI, the server and the harness share.

A document read whole is read "as text" by default: its key/values as the frozen model computes them, which for a
single document and no skimmed ones is exactly the model reading it in the prompt (`whole_reading="text"`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import DECODER, ENCODER, PROBE_RATIO, NuggetConfig, nugget_count
from ..generation.text import words

if TYPE_CHECKING:
    from langchain_core.documents import Document

    from ..state.nugget_state import NuggetState
    from .compressor import Compressed

PROBE_INSTRUCTION = "Please write a question about the passage above."


@runtime_checkable
class PlanCompressor(Protocol):
    """What a reading plan asks of the compressor (NuggetCompressor): documents' lengths and states, one reading
    block, and the question-likelihood probe."""

    @property
    def effective_ratio(self) -> float: ...

    def token_counts(self, documents: Sequence[Document | str]) -> list[int]: ...

    def reading(self, documents: Sequence[Document | str] = ()) -> AbstractContextManager: ...

    def states(self, documents: Sequence[Document | str], ratios: float | Sequence[float] | None = None,
               adapter: str | None = ENCODER) -> list[NuggetState]: ...

    def lookup(self, documents: Sequence[Document | str], ratios: float | Sequence[float] | None = None,
               adapter: str | None = ENCODER) -> list[Compressed]: ...

    def question_likelihoods(self, states: Sequence[NuggetState], instruction: str, question: str,
                             adapter: str | None, batch: int) -> list[float]: ...


class DocumentReading(NamedTuple):
    """How one document is read: at `ratio` (None: dropped), with the state of `adapter`, and why."""

    ratio: float | None
    adapter: str | None
    positions: int
    relevance: float | None
    reason: str

    def as_metadata(self) -> dict:
        return {"ratio": self.ratio, "positions": self.positions, "relevance": self.relevance,
                "reason": self.reason, "read_as": None if self.ratio is None else
                "text" if self.adapter is None else "nuggets"}


class PlannedReading(NamedTuple):
    """Documents read as planned: every document's reading (in the order given), the states of those read (in
    that order, dropped ones left out) and the decoder adapter that reads them."""

    readings: list[DocumentReading]
    found: list[Compressed]
    adapter: str | None


class ResolutionPolicy(BaseModel):
    """Chooses each document's ratio for a question under a budget of positions; subclasses score relevance."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    label: ClassVar[str] = ""

    budget: float = Field(0.35, gt=0, le=1, description="Share of the documents' tokens the answer may read; the "
                          "documents read whole always are, and skims take what they leave.")
    max_positions: int | None = Field(None, ge=1, description="A cap in positions on top of the share.")
    expand: int = Field(1, ge=0, description="Documents read whole (the most relevant first).")
    expand_margin: float | None = Field(None, ge=0, description="Also read whole each next document whose relevance "
                                        "is within this of the top document's (None: exactly `expand`).")
    expand_max: int = Field(2, ge=1, description="The most documents `expand_margin` reads whole.")
    skim_ratio: float | None = Field(None, description="Ratio the other documents are read at; None drops them.")
    whole_reading: Literal["text", "nuggets"] = Field(
        "text", description="A whole document as the frozen model reads its text, or as the encoder's nuggets at r=1.")

    @field_validator("skim_ratio", mode="before")
    @classmethod
    def _check_skim(cls, value: object) -> float | None:
        return None if value is None else NuggetConfig(ratio=value).ratio

    def relevance(self, question: str, texts: Sequence[str], compressor: PlanCompressor) -> list[float]:
        """One score per document, higher for more relevant."""
        raise NotImplementedError

    def plan(self, question: str, documents: Sequence[Document | str],
             compressor: PlanCompressor) -> list[DocumentReading]:
        """Each document's reading, in the order given (its length in tokens as the compressor's metadata names it,
        else tokenised). A ValueError if there is nothing to plan for."""
        if not documents:
            raise ValueError(f"{type(self).__name__} got no documents to read; retrieve at least one")
        texts = [d if isinstance(d, str) else d.page_content for d in documents]
        lengths = compressor.token_counts(documents)
        scores = [float(s) for s in self.relevance(question, texts, compressor)]
        if len(scores) != len(texts) or not all(math.isfinite(s) for s in scores):
            raise ValueError(f"{type(self).__name__} gave relevance {scores} for {len(texts)} documents")
        return self.allocate(scores, lengths)

    def read(self, question: str, documents: Sequence[Document | str], compressor: PlanCompressor) -> PlannedReading:
        """Plan the documents' readings, then look each up at its ratio in its adapter's stored state (the one path
        NuggetLLM, the chain, the CLI and the harness read documents by), in one `NuggetCompressor.reading`: each
        stored state is read from the store once (the state a probe scored is the one the answer reads), by the key
        a document's metadata names."""
        with compressor.reading(documents):
            readings = self.plan(question, documents, compressor)
            picked = [i for i, r in enumerate(readings) if r.ratio is not None]
            found: dict[int, Compressed] = {}
            for adapter in dict.fromkeys(readings[i].adapter for i in picked):
                group = [i for i in picked if readings[i].adapter == adapter]
                looked = compressor.lookup([documents[i] for i in group], [readings[i].ratio for i in group], adapter)
                found.update(zip(group, looked))
        return PlannedReading(readings, [found[i] for i in picked], self.decoder_adapter(readings))

    def positions_budget(self, lengths: Sequence[int]) -> int:
        share = max(1, math.floor(self.budget * sum(lengths)))
        return min(share, self.max_positions) if self.max_positions else share

    def expansions(self, scores: Sequence[float]) -> int:
        """How many documents to read whole for this question: `expand`, plus each next one whose relevance is
        within `expand_margin` of the top document's (at most `expand_max` in all)."""
        count = min(self.expand, len(scores))
        if self.expand_margin is None or count == 0:
            return count
        ranked = sorted(scores, reverse=True)
        while count < min(self.expand_max, len(ranked)) and ranked[0] - ranked[count] <= self.expand_margin:
            count += 1
        return count

    def allocate(self, scores: Sequence[float], lengths: Sequence[int]) -> list[DocumentReading]:
        """The top documents (`expansions`) are read whole, always; the rest at `skim_ratio` with what the budget
        has left after them (the least relevant are dropped first), or dropped."""
        budget = self.positions_budget(lengths)
        order = sorted(range(len(lengths)), key=lambda i: -scores[i])  # stable: ties keep the given order
        rank = {doc: place for place, doc in enumerate(order)}
        expand = self.expansions(scores)
        expanded, rest = order[:expand], order[expand:]
        skimmed = list(rest) if self.skim_ratio else []
        cost = {i: nugget_count(lengths[i], self.skim_ratio) for i in skimmed}
        left = budget - sum(lengths[i] for i in expanded)  # the evidence comes first: skims take what it leaves
        while skimmed and sum(cost[i] for i in skimmed) > left:
            skimmed.pop()
        if not expanded and not skimmed:
            smallest = min(nugget_count(n, self.skim_ratio or 1.0) for n in lengths)
            raise ValueError(f"a budget of {budget} positions holds none of the {len(lengths)} documents (the "
                             f"smallest takes {smallest}); raise budget (now {self.budget}) or expand (now {self.expand})")
        tag = f"by {self.label}" if self.label else ""
        whole_adapter = None if self.whole_reading == "text" else ENCODER
        whole_as = "as text" if whole_adapter is None else "as nuggets at r=1"
        readings: dict[int, DocumentReading] = {}
        for i in expanded:
            readings[i] = DocumentReading(1.0, whole_adapter, lengths[i], scores[i],
                                          f"rank {rank[i] + 1} of {len(order)} {tag}: read whole {whole_as}")
        for i in skimmed:
            readings[i] = DocumentReading(self.skim_ratio, ENCODER, cost[i], scores[i],
                                          f"rank {rank[i] + 1} of {len(order)} {tag}: skimmed at r={self.skim_ratio:g}")
        for i in order:
            if i not in readings:
                why = "the budget holds no more" if self.skim_ratio else f"only the top {expand} are read"
                readings[i] = DocumentReading(None, None, 0, scores[i],
                                              f"rank {rank[i] + 1} of {len(order)} {tag}: dropped ({why})")
        return [readings[i] for i in range(len(lengths))]

    def decoder_adapter(self, readings: Sequence[DocumentReading]) -> str | None:
        """The decoder adapter for these readings: none when every document read is read as text (then the
        answer is the frozen model's reading of those texts), else the trained decoder."""
        return DECODER if any(r.adapter is not None for r in readings if r.ratio is not None) else None


class RetrieverRank(ResolutionPolicy):
    """The documents' own order: a retriever's ranking, the first the most relevant."""

    label: ClassVar[str] = "retriever rank"

    def relevance(self, question, texts, compressor):
        return [-float(i) for i in range(len(texts))]


class UniformResolution(RetrieverRank):
    """Every document as nuggets at `skim_ratio` (None: the compressor's ratio), in the given order: the paper's
    reading, and the one for documents the model cannot read as text (summaries of long documents)."""

    label: ClassVar[str] = "given order"
    budget: float = 1.0
    expand: int = 0
    skim_ratio: float | None = None

    def plan(self, question, documents, compressor):
        if self.skim_ratio is None:
            return self.model_copy(update={"skim_ratio": compressor.effective_ratio}).plan(question, documents,
                                                                                          compressor)
        return super().plan(question, documents, compressor)


class LexicalRerank(ResolutionPolicy):
    """BM25 (Okapi, rank-bm25) of the question's words against the documents' words, the documents as the corpus."""

    label: ClassVar[str] = "BM25"

    def relevance(self, question, texts, compressor):
        try:
            from rank_bm25 import BM25Okapi
        except ImportError as err:
            raise ImportError("LexicalRerank needs rank-bm25: pip install 'nugget-rag[retrieval]'") from err
        return BM25Okapi([words(t) or [""] for t in texts]).get_scores(words(question)).tolist()


class QueryLikelihood(ResolutionPolicy):
    """Mean log-probability of the question's tokens given each document, read from the store at `probe_ratio`
    (training-free; the question-likelihood reranking of UPR, Sachan et al., 2022): one pass over the question's
    tokens per document, against its cached key/values, `probe_batch` documents a forward pass (a cancelled request,
    cancellation.py, stops between passes): `PlanCompressor.question_likelihoods`."""

    label: ClassVar[str] = "question likelihood"
    probe_ratio: float = Field(PROBE_RATIO, description="Ratio the documents are read at to score them.")
    probe_reading: Literal["text", "nuggets"] = Field(
        "nuggets", description="Read as the encoder's nuggets by the decoder, or as text by the frozen model.")
    probe_batch: int = Field(16, ge=1, description="Documents scored in one forward pass.")

    def relevance(self, question, texts, compressor):
        adapter = None if self.probe_reading == "text" else ENCODER
        states = compressor.states(list(texts), self.probe_ratio, adapter=adapter)
        return compressor.question_likelihoods(states, PROBE_INSTRUCTION, question, adapter, self.probe_batch)


POLICIES: dict[str, type[ResolutionPolicy]] = {
    "uniform": UniformResolution, "rank": RetrieverRank, "lexical": LexicalRerank, "likelihood": QueryLikelihood,
}
RESOLUTIONS = ("default", *POLICIES)
DEFAULT_EXPAND_MARGIN = 0.3  # chosen on squad_rag dev: benchmarks/reading_plan.py


def default_resolution() -> ResolutionPolicy:
    """The policy measured best on squad_rag dev (BENCHMARKS.md, "Reading retrieved passages"): the question's
    likelihood given each passage's nuggets at r = 4 picks the passage read whole, as text, and a second one when
    its likelihood is within 0.3 nats a token of the first's (multi-hop questions need two; on squad_rag dev this
    reads two for 32% of the questions at no loss, where two always lose 12.5 points); the rest are dropped
    (skimming them at r = 10 answered 23% against 42% with stage 5; with the default of 2026-11-29 it answers more,
    but by reciting a passage: its decoder adapter never learnt to answer from a whole passage beside nuggets, which
    the rag_qa objective trains; BENCHMARKS.md, "The reading plan with the new default")."""
    return QueryLikelihood(expand_margin=DEFAULT_EXPAND_MARGIN)


def resolve_policy(value: ResolutionPolicy | type[ResolutionPolicy] | str) -> ResolutionPolicy:
    """A policy from a name of `RESOLUTIONS`, a policy class (its defaults) or a policy (itself)."""
    if isinstance(value, ResolutionPolicy):
        return value
    if isinstance(value, type) and issubclass(value, ResolutionPolicy):
        return value()
    if value == "default":
        return default_resolution()
    if isinstance(value, str) and value in POLICIES:
        return POLICIES[value]()
    raise ValueError(f"unknown resolution {value!r}: give one of {', '.join(map(repr, RESOLUTIONS))}, a "
                     "ResolutionPolicy subclass or an instance of one")

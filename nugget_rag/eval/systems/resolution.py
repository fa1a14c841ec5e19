"""Per-document resolution for RAG tasks: the retriever's first passage alone, and each resolution policy.

`<policy>_select` reads the passage the policy ranks first whole and drops the rest; `<policy>_adaptive` reads it
whole and skims the others at the run's ratio; both within the policy's budget (0.35 of the passages' tokens).
`likelihood_*_top2` and `oracle_*_top2` read the first two whole (multi-hop: HotpotQA's answers need two paragraphs).
`oracle_*` choose the gold passages (the task knows them): a reference, not a system.
"""

from __future__ import annotations

import itertools
from typing import ClassVar

from pydantic import Field

from ...components.compressor import NuggetCompressor
from ...components.resolution import POLICIES, ResolutionPolicy, default_resolution
from .base import Env, Reading, Skipped, System, register

QA = frozenset({"qa"})


@register("top1_text")
class TopPassageText(System):
    label = "k = 1 text (the first passage alone)"
    uses_ratio = False
    kinds = QA
    in_default = False
    description = "The frozen model reading the retriever's first passage in the prompt, the others left out."
    passages: ClassVar[int] = 1

    def prepare(self, env: Env, queries, ratio):
        return [Reading(texts=list(q.documents[: self.passages]), text_ids=list(q.document_ids[: self.passages]))
                for q in queries]


@register("top2_text")
class TopTwoPassagesText(TopPassageText):
    label = "k = 2 text (the first two passages)"
    description = "The frozen model reading the retriever's first two passages in the prompt, the others left out."
    passages = 2


class GoldChoice(ResolutionPolicy):
    """The passages that hold the answer first (the task's gold): the oracle's choice."""

    label: ClassVar[str] = "gold"
    gold: list[int] = Field(default_factory=list)

    def relevance(self, question, texts, compressor):
        return [1.0 if i in self.gold else 0.0 for i in range(len(texts))]


class PolicyReading(System):
    """Documents read as a resolution policy plans them (ResolutionPolicy.read), from a compressor on the run's
    model (memory store)."""

    kinds = QA
    in_default = False
    policy: ClassVar[type[ResolutionPolicy]]
    skim: ClassVar[bool]
    expand: ClassVar[int] = 1
    whole_reading: ClassVar[str] = "text"

    def policy_for(self, query, ratio) -> ResolutionPolicy:
        return self.policy(skim_ratio=ratio if self.skim else None, expand=self.expand, whole_reading=self.whole_reading)

    def prepare(self, env: Env, queries, ratio):
        compressor = env.cache.get("resolution_compressor")
        if compressor is None:
            compressor = NuggetCompressor(model=env.model, keep_ratio=env.keep_ratio)
            env.cache["resolution_compressor"] = compressor
        out: list[Reading | Skipped] = []
        for q in queries:
            if any(len(ids) == 0 for ids in q.document_ids):
                out.append(Skipped("empty document"))
                continue
            readings, found, adapter = self.policy_for(q, ratio).read(q.question, q.documents, compressor)
            info = {"relevance": [r.relevance for r in readings],
                    "read_whole": sum(r.ratio == 1 for r in readings)}  # per question, in the predictions file
            if q.gold:
                info |= {"gold_read_whole": int(any(readings[g].ratio == 1 for g in q.gold)),
                         "gold_dropped": int(any(readings[g].ratio is None for g in q.gold))}
            out.append(Reading(states=[f.state for f in found], adapter=adapter, info=info))
        return out


class GoldReading(PolicyReading):
    """The oracle: the task's gold passages ranked first."""

    policy = GoldChoice

    def policy_for(self, query, ratio) -> ResolutionPolicy:
        return super().policy_for(query, ratio).model_copy(update={"gold": query.gold})


_DESCRIPTIONS = {
    "rank": "the retriever's first passage", "lexical": "the passage BM25 ranks first",
    "likelihood": "the passage under which the question is most likely (the decoder reading each one's nuggets at r=4)",
    "oracle": "the gold passage",
}
for _name, _policy in [*POLICIES.items(), ("oracle", GoldChoice)]:
    if _name == "uniform":
        continue
    for _skim, _expand in itertools.product((False, True), (1, 2) if _name in ("likelihood", "oracle") else (1,)):
        _suffix = ("adaptive" if _skim else "select") + ("" if _expand == 1 else f"_top{_expand}")
        _first = "first passage" if _expand == 1 else f"first {_expand} passages"
        _base = GoldReading if _policy is GoldChoice else PolicyReading
        register(f"{_name}_{_suffix}")(type(f"{_policy.__name__}{_suffix.title()}", (_base,), {
            "policy": _policy, "skim": _skim, "uses_ratio": _skim, "expand": _expand,
            "label": f"{_name}: {_first} whole" + (", the rest at r" if _skim else ", the rest dropped"),
            "description": f"Reads {_DESCRIPTIONS[_name]}" + ("" if _expand == 1 else f" (the top {_expand})")
                           + " whole as text" + (", the others as nuggets at r." if _skim else " and drops the others."),
        }))


@register("oracle_adaptive_nuggets")
class GoldNuggetsAdaptive(GoldReading):
    label = "oracle: gold passage as nuggets at r = 1, the rest at r"
    description = "The gold passage as the encoder's nuggets at r = 1 (not as text), the others at r."
    skim = True
    whole_reading = "nuggets"


@register("default_reading")
class DefaultReading(PolicyReading):
    label = "the default: default_resolution()"
    description = "The chain's default policy (nugget_rag.resolution.default_resolution), as NuggetLLM reads by default."
    uses_ratio = False

    def policy_for(self, query, ratio) -> ResolutionPolicy:
        return default_resolution()

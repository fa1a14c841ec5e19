"""Long documents to summarise, with what a summary of each should name.

- Digests: `size` CNN/DailyMail articles of one split joined, drawn `count` times by a seeded sample; the reference
  is their highlights in order. Coverage is the share of the digest's articles the summary mentions, an article
  being mentioned when the summary names one of its highlights' capitalised words (names, places) that no other
  article of the digest's highlights uses.
- Reference topics: topics of Python's language reference (`pydoc_data.topics`, shipped with Python) longer than
  the default model's 8,192 positions. They have no reference summary; coverage is the share of the topic's key
  terms (its sections' subjects, written out by hand below) the summary names.

Dev digests come from dev articles only and test digests from test articles only (`../shared/data/splits.json`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..corpora import read_summarization

# A topic's key terms: name -> pattern (case-insensitive) that a summary naming it matches.
TOPIC_TERMS: dict[str, dict[str, str]] = {
    "compound": {
        "if": r"\bif\b[\"'`]?\s+(statement|clause|block)|[\"'`]if[\"'`]|\belif\b",
        "while": r"\bwhile\b[\"'`]?\s+(statement|loop|clause)|[\"'`]while[\"'`]",
        "for": r"\bfor\b[\"'`]?\s+(statement|loop|clause)|[\"'`]for[\"'`]",
        "try": r"\btry\b|\bexcept\b|\bexceptions?\b|\bfinally\b",
        "with": r"\bwith\b[\"'`]?\s+statement|[\"'`]with[\"'`]|context manager",
        "match": r"\bmatch\b|\bpatterns?\b|\bcase\b",
        "function definitions": r"\bfunctions?\b|\bdef\b",
        "class definitions": r"\bclass(es)?\b",
        "async": r"\basync\b|\bcoroutines?\b|\bawait\b",
    },
    "specialnames": {
        "basic customization": r"__init__|__new__|__repr__|__str__|__del__|constructor",
        "attribute access": r"attribute access|__getattr|__setattr|__getattribute__",
        "descriptors": r"\bdescriptors?\b|__get__|__set__",
        "__slots__": r"__slots__|\bslots\b",
        "metaclasses": r"\bmetaclass(es)?\b|class creation",
        "instance and subclass checks": r"isinstance|issubclass|__instancecheck__|__subclasscheck__",
        "generic types": r"__class_getitem__|generic",
        "callable objects": r"__call__|\bcallables?\b",
        "container types": r"\bcontainers?\b|__len__|__getitem__|__iter__|__contains__",
        "numeric types": r"\bnumeric\b|__add__|arithmetic|\boperators?\b",
        "context managers": r"context manager|__enter__|__exit__|\bwith\b[\"'`]?\s+statement",
        "special method lookup": r"special methods?|magic methods?|dunder",
    },
    "types": {
        "None": r"\bNone\b",
        "NotImplemented and Ellipsis": r"NotImplemented|Ellipsis",
        "numbers": r"\bnumbers?\b|\bintegers?\b|\bfloat|\bcomplex\b|\bnumeric\b",
        "sequences": r"\bsequences?\b|\blists?\b|\btuples?\b|\bstrings?\b",
        "sets": r"\bsets?\b|frozenset",
        "mappings": r"\bmappings?\b|\bdictionar(y|ies)\b|\bdicts?\b",
        "callable types": r"\bcallables?\b|\bfunctions?\b|\bmethods?\b",
        "generators and coroutines": r"\bgenerators?\b|\bcoroutines?\b|\basync",
        "classes and instances": r"\bclass(es)?\b|\binstances?\b",
        "modules": r"\bmodules?\b",
        "I/O objects": r"file objects?|\bI/O\b|\bfiles?\b",
        "internal types": r"code objects?|frame objects?|traceback|slice objects?|internal types?",
    },
}
_WORD = re.compile(r"[A-Z][\w\-]+")
_COMMON = {"The", "A", "An", "He", "She", "It", "They", "We", "His", "Her", "Its", "Their", "In", "On", "At", "For",
           "But", "And", "Mr", "Mrs", "Ms", "Dr", "New", "This", "That", "There", "Police", "Some", "One", "Two", "CNN"}


@dataclass
class LongDocument:
    """One long document: its id, text, reference summary (None for a topic), and for coverage either its parts'
    distinctive words (a digest: one set per article) or its key terms' patterns (a topic)."""

    id: str
    text: str
    reference: str | None
    article_words: list[set[str]] = field(default_factory=list)
    terms: dict[str, str] = field(default_factory=dict)

    def coverage(self, summary: str) -> tuple[float, list[str]]:
        """The share of the articles (or key terms) the summary names, and which: article numbers from 1, or terms."""
        if self.terms:
            named = [term for term, pattern in self.terms.items() if re.search(pattern, summary, re.IGNORECASE)]
            return len(named) / len(self.terms), named
        words = set(_WORD.findall(summary))
        named = [str(i + 1) for i, mine in enumerate(self.article_words) if mine & words]
        return len(named) / len(self.article_words), named


def highlight_words(highlights: str) -> set[str]:
    """The capitalised words of an article's highlights (names, places), less common sentence openers."""
    return {w for w in _WORD.findall(highlights) if w not in _COMMON}


def digests(path: str | Path, split: str, size: int = 12, count: int = 4, seed: int = 0) -> list[LongDocument]:
    """`count` digests of `size` articles of `split`, each a seeded sample of the split's articles in file order."""
    records = read_summarization(path, split)
    if size > len(records):
        raise ValueError(f"a digest of {size} articles needs {size}; split {split!r} of {path} has {len(records)}")
    out = []
    for i in range(count):
        chosen = sorted(random.Random(f"{seed}:{i}").sample(range(len(records)), size))
        group = [records[j] for j in chosen]
        own = [highlight_words(r["summary"]) for r in group]
        distinctive = [mine - set().union(*(o for j, o in enumerate(own) if j != k)) for k, mine in enumerate(own)]
        out.append(LongDocument(
            id=f"{split}-digest-{i}", text="\n\n".join(r["document"].strip() for r in group),
            reference="\n".join(r["summary"].strip() for r in group), article_words=distinctive))
    return out


def reference_topics(names: list[str] | None = None) -> list[LongDocument]:
    """Topics of Python's language reference with their key terms (default: every topic of TOPIC_TERMS)."""
    from pydoc_data.topics import topics

    names = list(TOPIC_TERMS) if names is None else names
    unknown = [n for n in names if n not in TOPIC_TERMS or n not in topics]
    if unknown:
        raise ValueError(f"no key terms for topic(s) {unknown}; choose from {sorted(TOPIC_TERMS)}")
    return [LongDocument(id=f"topic-{n}", text=topics[n], reference=None, terms=TOPIC_TERMS[n]) for n in names]

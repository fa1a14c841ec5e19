"""Plain-text helpers shared by the request path and training."""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence


def words(text: str) -> list[str]:
    """Lowercased word tokens, as BM25 reads a text."""
    return re.findall(r"\w+", text.lower())


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


def ends_sentence(text: str) -> bool:
    """Whether `text` ends a sentence: '.', '!' or '?' (closing quotes or brackets after it) before any trailing
    whitespace, or a blank line; a single line break (text wrapped as its source was) does not."""
    return text.endswith("\n\n") or _SENTENCE_END.search(text.rstrip()) is not None


def first_repeat(tokens: Sequence[Hashable], n: int) -> int | None:
    """The index of the first token that completes an n-gram already seen in `tokens` (None: no n-gram repeats)."""
    if n < 1:
        raise ValueError(f"an n-gram has at least one token, got n={n}")
    seen: set[tuple[Hashable, ...]] = set()
    for end in range(n, len(tokens) + 1):
        gram = tuple(tokens[end - n : end])
        if gram in seen:
            return end - 1
        seen.add(gram)
    return None

"""Plain-text helpers shared by the request path and training."""

from __future__ import annotations

import re


def words(text: str) -> list[str]:
    """Lowercased word tokens, as BM25 reads a text."""
    return re.findall(r"\w+", text.lower())


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


def ends_sentence(text: str) -> bool:
    """Whether `text` ends a sentence: '.', '!' or '?' (closing quotes or brackets after it) before any trailing
    whitespace, or a blank line; a single line break (text wrapped as its source was) does not."""
    return text.endswith("\n\n") or _SENTENCE_END.search(text.rstrip()) is not None

"""Plain-text helpers shared by the request path and training."""

from __future__ import annotations

import re


def words(text: str) -> list[str]:
    """Lowercased word tokens, as BM25 reads a text."""
    return re.findall(r"\w+", text.lower())

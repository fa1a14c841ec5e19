"""No repeated n-gram as printed: tokens compared by the text they print, not by their ids.

A word is often two tokens: one with a leading space and one without (after a line break, or at the start of an
answer), so an answer can repeat a run of words while no run of token ids repeats. `NoRepeatPrintedNGram` compares
each token by its text without surrounding whitespace and skips tokens that print only whitespace; it also bars a
repeated n-gram of token ids, as transformers' NoRepeatNGramLogitsProcessor does, which stops runs of whitespace.
"""

from __future__ import annotations

import functools

import torch
from transformers import LogitsProcessor

from .text import first_repeat

SPACE = -1  # the form of a token that prints nothing but whitespace (or nothing at all)


@functools.cache
def printed_forms(tokenizer) -> torch.Tensor:
    """One id per token: equal for tokens that print the same text once whitespace is stripped, SPACE for tokens
    that print only whitespace. A token that is part of a multi-byte character keeps its own form."""
    ids = list(range(len(tokenizer)))
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=True)
    raw = tokenizer.convert_ids_to_tokens(ids)
    codes: dict[str, int] = {}
    forms = []
    for text, token in zip(texts, raw):
        form = token if "\ufffd" in text else text.strip()
        forms.append(codes.setdefault(form, len(codes)) if form else SPACE)
    return torch.tensor(forms, dtype=torch.long)


def first_printed_repeat(token_ids: list[int], tokenizer, n: int) -> int | None:
    """The index (among the tokens that print more than whitespace) of the first token completing an n-gram of
    printed forms already seen; None: none repeats."""
    forms = printed_forms(tokenizer)
    return first_repeat([f for f in forms[token_ids].tolist() if f != SPACE], n)


def completions(seq: list[int], n: int) -> set[int]:
    """The items that would complete, after `seq`, an n-gram already in it."""
    if len(seq) < n - 1:
        return set()
    prefix = seq[len(seq) - n + 1 :]
    return {seq[i + n - 1] for i in range(len(seq) - n + 1) if seq[i : i + n - 1] == prefix}


class NoRepeatPrintedNGram(LogitsProcessor):
    """Bars every token that would complete an n-gram already in the row: of printed forms, or of token ids."""

    def __init__(self, n: int, tokenizer):
        if n < 1:
            raise ValueError(f"no_repeat_ngram_size must be at least 1 (0 turns the rule off), got {n}")
        self.n = n
        self.forms = printed_forms(tokenizer)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forms = self.forms.to(scores.device)
        for row, (ids, printed) in enumerate(zip(input_ids.tolist(), forms[input_ids].tolist())):
            barred = completions([f for f in printed if f != SPACE], self.n)
            if barred:
                scores[row, torch.isin(forms, torch.tensor(sorted(barred), device=scores.device))] = -float("inf")
            same_ids = completions(ids, self.n)
            if same_ids:
                scores[row, sorted(same_ids)] = -float("inf")
        return scores

"""Task metrics: SQuAD accuracy with the Dodo paper's normalisation (Appendix E), BLEU (sacrebleu), ROUGE."""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence

_NUMBERS = {
    "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7",
    "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12", "thirteen": "13", "fourteen": "14",
    "fifteen": "15", "sixteen": "16", "seventeen": "17", "eighteen": "18", "nineteen": "19", "twenty": "20",
    "thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90",
    "hundred": "100", "thousand": "1000", "million": "1000000", "billion": "1000000000",
}
_PUNCTUATION = re.compile(f"[{re.escape(string.punctuation)}\u2018\u2019\u201c\u201d\u2013\u2014]")


def normalize_answer(text: str) -> str:
    """Appendix E: number words to digits, punctuation to spaces, strip, lowercase (spaces collapsed)."""
    words = _PUNCTUATION.sub(" ", text.lower()).split()
    return " ".join(_NUMBERS.get(w, w) for w in words)


def answer_correct(prediction: str, answers: Sequence[str]) -> bool:
    """Appendix E: correct when the normalised prediction contains any normalised gold answer."""
    pred = normalize_answer(prediction)
    return any(g and g in pred for g in map(normalize_answer, answers))


def bleu(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU (sacrebleu, 0..100) of predictions against one reference each."""
    import sacrebleu

    _same_length(predictions, references)
    return float(sacrebleu.corpus_bleu(list(predictions), [list(references)]).score)


def rouge(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1 (rouge-score, stemmed; 0..100) of predictions against one reference each."""
    from rouge_score import rouge_scorer

    _same_length(predictions, references)
    if not predictions:
        raise ValueError("rouge() needs at least one prediction")
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for pred, ref in zip(predictions, references):
        for name, score in scorer.score(ref, pred).items():
            totals[name] += score.fmeasure
    return {name: 100 * value / len(predictions) for name, value in totals.items()}


def paired_difference(before: Sequence[float], after: Sequence[float]) -> tuple[float, float]:
    """The mean of after - before over paired examples, and its standard error."""
    if len(before) != len(after) or not before:
        raise ValueError(f"need the same examples before and after, at least one: got {len(before)} and {len(after)}")
    diff = [a - b for a, b in zip(after, before)]
    mean = sum(diff) / len(diff)
    return mean, math.sqrt(sum((d - mean) ** 2 for d in diff) / max(len(diff) - 1, 1) / len(diff))


def _same_length(predictions: Sequence[str], references: Sequence[str]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")

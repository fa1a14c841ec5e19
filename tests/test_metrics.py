"""Task metrics against hand-checked values (paper App. E normalisation, sacrebleu BLEU, rouge-score ROUGE)."""

from __future__ import annotations

import pytest

from nugget_rag.eval.metrics import answer_correct, bleu, normalize_answer, rouge


@pytest.mark.parametrize("text, expected", [
    ("Two", "2"),
    ("twenty", "20"),
    ("  Paris  ", "paris"),
    ("U.S.A.!", "u s a"),
    ("Denver Broncos,", "denver broncos"),
    ("“Quoted” — text", "quoted text"),
    ("three-point shot", "3 point shot"),
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize("prediction, answers, correct", [
    ("There are two dogs.", ["2"], True),  # number words become digits
    ("2", ["two"], True),
    ("The answer is: Denver Broncos!", ["Denver Broncos"], True),  # punctuation and extra words
    ("the u.s. army", ["U.S."], True),
    ("DENVER", ["denver"], True),  # case
    ("London", ["Paris", "the city of Paris"], False),
    ("", ["Paris"], False),  # an empty output is wrong, not skipped
    ("anything", [""], False),  # an empty gold answer matches nothing
    ("Paris", ["Lyon", "Paris"], True),  # any of the gold answers
])
def test_answer_correct(prediction, answers, correct):
    assert answer_correct(prediction, answers) is correct


def test_bleu_identical_is_100_and_disjoint_is_0():
    texts = ["the cat sat on the mat by the door", "nuggets are the tokens kept by the scorer"]
    assert bleu(texts, texts) == pytest.approx(100.0)
    assert bleu(["alpha beta gamma delta"], ["one two three four"]) == pytest.approx(0.0)
    assert 0 < bleu(["the cat sat on the mat by the window"], ["the cat sat on the mat by the door"]) < 100


def test_rouge_disjoint_is_0_and_identical_is_100():
    assert rouge(["alpha beta gamma"], ["one two three"]) == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    same = rouge(["the falcon dives at great speed"], ["the falcon dives at great speed"])
    assert same == pytest.approx({"rouge1": 100.0, "rouge2": 100.0, "rougeL": 100.0})
    # hand-checked: 2 of 3 unigrams shared both ways -> P = R = F1 = 2/3; one shared bigram of two -> 1/2
    partial = rouge(["falcon dives fast"], ["falcon dives slowly"])
    assert partial["rouge1"] == pytest.approx(200 / 3) and partial["rouge2"] == pytest.approx(50.0)


def test_metric_inputs_must_align():
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        bleu(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="at least one"):
        rouge([], [])

"""The benchmark scripts' own logic (benchmarks/ is not a package: loaded by path)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "nugget_tokens.py"


@pytest.fixture(scope="module")
def nugget_tokens():
    spec = importlib.util.spec_from_file_location("nugget_tokens", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TEXTS = ["The cat sat on the mat, and the dog sat too.", "A list (or a tuple) holds items; a dict maps keys."]


def test_selection_statistics_count_every_nugget(nugget_tokens, make_model, doc_ids):
    model = make_model(ratio=3.0)
    docs = [doc_ids(t) for t in TEXTS]
    stats = nugget_tokens.selection_statistics(model, docs, batch_size=1)
    assert stats["nuggets"] == sum(s.k for s in model.compress(docs))
    assert stats["tokens"] == sum(map(len, docs))
    shares = [t["nugget_share"] for t in stats["top"]]
    assert len(shares) <= nugget_tokens.TOP and shares == sorted(shares, reverse=True)
    assert stats["top10_coverage"] == pytest.approx(sum(shares))


def test_keeping_every_token_gives_the_texts_frequencies(nugget_tokens, make_model, doc_ids):
    stats = nugget_tokens.selection_statistics(make_model(ratio=1.0), [doc_ids(t) for t in TEXTS], batch_size=2)
    assert stats["nuggets"] == stats["tokens"]
    assert stats["text_punctuation_share"] > 0
    assert stats["punctuation_share"] == pytest.approx(stats["text_punctuation_share"])
    for row in stats["top"]:
        assert row["nugget_share"] == pytest.approx(row["text_share"])
    assert stats["gap_mean"] == 1 and stats["gap_stdev"] == 0

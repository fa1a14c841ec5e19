"""The benchmark scripts' own logic (benchmarks/ is not a package: loaded by path)."""

import argparse
import importlib.util
from pathlib import Path

import pytest
from tiny import tiny_base

from nugget_rag.config import DECODER

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def nugget_tokens():
    return load_script("nugget_tokens")


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


def test_adapter_overhead_times_every_system_and_restores_the_merge_setting(make_model):
    overhead = load_script("adapter_overhead")
    model = make_model(ratio=4.0)
    args = argparse.Namespace(documents=2, doc_tokens=24, ratio=4.0, steps=3, repeats=1)
    result = overhead.measure(model, args)
    assert list(result["rows"]) == ["Full (adapters off)", *overhead.MODES]
    assert all(row["ttft_s"] > 0 and row["decode_s_per_token"] > 0 for row in result["rows"].values())
    assert result["nuggets"] == 2 * 6 and model.merged_adapters == (DECODER,)
    narrow = overhead.narrowed(tiny_base(layers=3), 16)
    assert narrow.model.config.hidden_size == 16 and narrow.model.config.num_hidden_layers == 3

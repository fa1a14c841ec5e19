"""A cancelled request's work stops at its next step: compression, the probe, generation; outside a block, nothing."""

import pytest
import torch

from nugget_rag import NuggetCompressor, NuggetStore
from nugget_rag.cancellation import RequestCancelled, cancellable, check
from nugget_rag.components.resolution import QueryLikelihood
from nugget_rag.generation import GenerationSettings, generation_steps
from nugget_rag.model import NuggetModel

TEXTS = [f"Passage {i}: the mill by the river grinds {i} sacks of flour a day." for i in range(6)]


def test_check_raises_only_inside_a_block_whose_stop_or_an_outer_one_is_true():
    check()  # no block: nothing
    stopped = False
    with cancellable(lambda: stopped):
        check()
        with cancellable(lambda: False):
            check()
            stopped = True
            with pytest.raises(RequestCancelled):
                check()  # the outer block's stop
        with pytest.raises(RequestCancelled):
            check()
    check()


def test_a_cancelled_compression_stops_before_its_next_batch_and_keeps_whole_states(make_model, tmp_path,
                                                                                   monkeypatch):
    store = NuggetStore(directory=tmp_path)
    compressor = NuggetCompressor(model=make_model(), store=store, batch_size=2)
    batches = []
    real = NuggetModel.compress
    monkeypatch.setattr(NuggetModel, "compress", lambda *args, **kwargs: batches.append(1) or real(*args, **kwargs))
    with cancellable(lambda: len(batches) >= 1), pytest.raises(RequestCancelled):
        compressor.invoke(TEXTS)
    assert len(batches) == 1
    keys = list(store.byte_store.yield_keys())
    assert len(keys) == 2 and all(NuggetStore(directory=tmp_path).get_by_key(key) is not None for key in keys)
    assert len(compressor.invoke(TEXTS)) == 6 and len(batches) == 1 + 2  # the stored two are not computed again


def test_a_cancelled_probe_stops_between_passes_and_passes_do_not_change_scores(make_model, monkeypatch):
    compressor = NuggetCompressor(model=make_model())
    question = "How many sacks does the mill grind?"
    whole = QueryLikelihood().relevance(question, TEXTS, compressor)  # one pass
    in_passes = QueryLikelihood(probe_batch=2).relevance(question, TEXTS, compressor)
    assert in_passes == pytest.approx(whole, abs=1e-5)
    passes = []
    real = NuggetCompressor._likelihood
    monkeypatch.setattr(NuggetCompressor, "_likelihood", lambda *a: passes.append(1) or real(*a))
    with cancellable(lambda: len(passes) >= 1), pytest.raises(RequestCancelled):
        QueryLikelihood(probe_batch=2).relevance(question, TEXTS, compressor)
    assert len(passes) == 1


def test_a_cancelled_generation_stops_at_its_next_step(make_model):
    model = make_model()
    with torch.no_grad():
        states = model.compress([model.tokenizer(TEXTS[0])["input_ids"]], ratio=4)
    steps = 0
    with cancellable(lambda: steps >= 3), pytest.raises(RequestCancelled):
        for _ in generation_steps(model, [states], [[5, 6, 7]], GenerationSettings(max_new_tokens=20)):
            steps += 1
    assert steps == 3

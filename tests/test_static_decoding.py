"""Decoding over a static KV cache (static_decoding.py) against the dynamic cache, on the tiny model."""

import itertools

import pytest
import torch

from nugget_rag.generation import GenerationSettings, eos_ids, generate, generation_steps
from nugget_rag.generation import decoding as generation
from nugget_rag.generation.static_decoding import CAPACITY_STEP, StaticDecoding

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
         "A stitch in time saves nine."]


@pytest.fixture
def setup(make_model, doc_ids):
    model = make_model()
    with torch.no_grad():
        states = model.compress([doc_ids(t) for t in TEXTS])
    samples = [[states[0]], [states[1], states[2]], [states[2], states[0], states[1]]]  # 1 to 3 documents a row
    prompts = [doc_ids(q) for q in ("Who?", "Where is the fox going now?", "When?")]  # left-padded in the batch
    return model, samples, prompts


def decode(model, mode, samples, prompts, settings, **kwargs):
    model.decoding = mode
    try:
        texts, ends = [""] * len(prompts), []
        for pieces, done in generation_steps(model, samples, prompts, settings, **kwargs):
            texts = [t + p for t, p in zip(texts, pieces)]
            ends.append(done)
        return texts, ends
    finally:
        model.decoding = "dynamic"


@pytest.mark.parametrize("settings", [GenerationSettings(max_new_tokens=16),
                                      GenerationSettings(max_new_tokens=10, temperature=1.0, seed=3)],
                         ids=["greedy", "sampled"])
def test_a_static_cache_decodes_as_the_dynamic_one(setup, settings):
    model, samples, prompts = setup
    dynamic = decode(model, "dynamic", samples, prompts, settings)
    static = decode(model, "static", samples, prompts, settings)
    assert static == dynamic
    assert all(end == "length" for end in dynamic[1][-1])  # no row left early: sampling draws for the same rows
    assert len(set(dynamic[0][0])) > 3  # varied text, so that a wrong step would show


def test_rows_that_end_stay_in_a_static_batch_and_say_nothing_more(setup, monkeypatch):
    model, samples, prompts = setup
    settings = GenerationSettings(max_new_tokens=6)
    eos, real, steps = min(eos_ids(model)), generation.next_token, itertools.count()
    widths = []

    def row_0_ends_at_step_1(logits, settings, generator):
        widths.append(logits.shape[0])
        tokens = real(logits, settings, generator)
        if next(steps) == 1:
            tokens[0] = eos
        return tokens

    monkeypatch.setattr(generation, "next_token", row_0_ends_at_step_1)
    leave: set[int] = set()
    model.decoding = "static"
    texts, ends = ["", "", ""], []
    for step, (pieces, done) in enumerate(generation_steps(model, samples, prompts, settings, leave=leave)):
        texts = [t + p for t, p in zip(texts, pieces)]
        ends.append(done)
        if step == 2:
            leave.add(1)  # cancelled after its third step
        if step > 2:
            assert pieces[0] == pieces[1] == ""
    model.decoding = "dynamic"
    assert widths == [3] * 6  # one shape for every step
    assert ends[1] == ["stop", None, None] and ends[-1] == ["stop", None, "length"]
    monkeypatch.setattr(generation, "next_token", real)
    assert texts[2] == generate(model, [samples[2]], [prompts[2]], settings)[0]


def test_an_unknown_decoding_is_named(setup):
    model, samples, prompts = setup
    model.decoding = "cuda_graphs"
    with pytest.raises(ValueError, match="'cuda_graphs'.*compiled"):
        generate(model, samples, prompts, GenerationSettings(max_new_tokens=2))
    model.decoding = "dynamic"


def test_the_cache_is_sized_in_steps_so_similar_requests_share_a_shape(setup):
    model, samples, _ = setup
    layout = model.layout(samples[:1], None, "decoder")
    present = torch.isfinite(layout.bias)
    decoding = StaticDecoding(model, layout.keys, layout.values, present, room=10, compiled=False)
    assert decoding.seen.shape[1] == CAPACITY_STEP and int(decoding.length) == present.shape[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (on a CPU, torch.compile takes "
                    "minutes to build the step and records no graph)")
def test_compiled_decoding_on_cuda_equals_eager_token_for_token(setup):
    model, samples, prompts = setup
    model.to("cuda")
    settings = GenerationSettings(max_new_tokens=16)
    eager = decode(model, "dynamic", samples, prompts, settings)
    assert decode(model, "compiled", samples, prompts, settings) == eager
    assert decode(model, "compiled", samples[:2], prompts[:2], settings)[0] == eager[0][:2]  # a new batch size

"""Batched decoding of concurrent requests on the tiny model."""

import itertools
import threading

import pytest
import torch

from nugget_rag.generation import GenerationSettings, eos_ids, generate, generation_steps
from nugget_rag.generation import decoding as generation
from nugget_rag.generation.batching import BatchedGenerator, RequestCancelled

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
         "A stitch in time saves nine.", "Water boils at one hundred degrees."]


@pytest.fixture
def setup(make_model, doc_ids):
    model = make_model()
    with torch.no_grad():
        states = model.compress([doc_ids(t) for t in TEXTS])
    prompts = [doc_ids(q) for q in ("Who?", "What is it?", "Where is the fox going now?", "When?")]
    return model, states, prompts


def run_together(batcher, states, prompts, settings) -> list[list[str]]:
    results: list = [None] * len(prompts)

    def ask(i):
        results[i] = list(batcher.stream([states[i]], prompts[i], settings))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_concurrent_requests_share_a_batch_and_answer_as_alone(setup):
    model, states, prompts = setup
    settings = GenerationSettings(max_new_tokens=10)
    batcher = BatchedGenerator(model, max_batch=8, wait_s=0.2)
    steps = run_together(batcher, states, prompts, settings)
    alone = [generate(model, [[s]], [p], settings)[0] for s, p in zip(states, prompts)]
    assert max(batcher.batch_sizes) >= 2 and sum(batcher.batch_sizes) == 4
    assert ["".join(s) for s in steps] == alone
    assert all(1 <= len(s) <= 10 for s in steps)  # one item per step, as a single-row stream


def test_batches_stop_at_max_batch_and_seeded_samples_run_alone(setup):
    model, states, prompts = setup
    batcher = BatchedGenerator(model, max_batch=2, wait_s=0.2)
    run_together(batcher, states, prompts, GenerationSettings(max_new_tokens=3))
    assert sorted(batcher.batch_sizes) == [2, 2]
    seeded = BatchedGenerator(model, max_batch=8, wait_s=0.2)
    run_together(seeded, states, prompts, GenerationSettings(max_new_tokens=3, temperature=1.0, seed=3))
    assert seeded.batch_sizes == [1, 1, 1, 1]


def test_a_consumer_that_leaves_does_not_stop_the_others(setup):
    model, states, prompts = setup
    settings = GenerationSettings(max_new_tokens=12)
    batcher = BatchedGenerator(model, max_batch=8, wait_s=0.2)
    first = batcher.stream([states[0]], prompts[0], settings)
    second = batcher.stream([states[1]], prompts[1], settings)
    next(first)
    first.close()
    assert "".join(second) == generate(model, [[states[1]]], [prompts[1]], settings)[0]


def test_a_cancelled_request_leaves_its_batch_at_the_next_step(setup):
    model, states, prompts = setup
    settings = GenerationSettings(max_new_tokens=200)
    batcher = BatchedGenerator(model, max_batch=8, wait_s=0.2)
    stop = threading.Event()
    cancelled = batcher.for_request(stop.is_set).stream([states[0]], prompts[0], settings)
    other = batcher.stream([states[1]], prompts[1], GenerationSettings(max_new_tokens=4))
    waiting = batcher.for_request(lambda: True).stream([states[2]], prompts[2], settings)  # gone before its turn
    next(cancelled)
    stop.set()
    with pytest.raises(RequestCancelled):
        list(cancelled)
    with pytest.raises(RequestCancelled):
        list(waiting)
    assert "".join(other) == generate(model, [[states[1]]], [prompts[1]], GenerationSettings(max_new_tokens=4))[0]
    assert batcher.batch_sizes == [1, 1]  # the waiting row never decoded


@pytest.fixture
def widths(setup, monkeypatch) -> list[int]:
    """The rows of every decoding pass of the setup's model (not those computing states)."""
    model, seen = setup[0], []
    run = model.run

    def counted(*args, **kwargs):
        if "inputs_embeds" in kwargs:
            seen.append(kwargs["inputs_embeds"].shape[0])
        return run(*args, **kwargs)

    monkeypatch.setattr(model, "run", counted)
    return seen


def test_a_cancelled_row_costs_no_forward_pass_after_it_leaves(setup, widths):
    model, states, prompts = setup
    settings = GenerationSettings(max_new_tokens=12)
    batcher = BatchedGenerator(model, max_batch=8, wait_s=0.2)
    cancelled = batcher.for_request(lambda: len(widths) >= 3).stream([states[0]], prompts[0], settings)  # 3 steps
    other = batcher.stream([states[1]], prompts[1], settings)
    assert "".join(other) == generate(model, [[states[1]]], [prompts[1]], settings)[0]
    with pytest.raises(RequestCancelled):
        list(cancelled)
    decoded = widths[:len(widths) - 1]  # the last pass: generate's, alone
    assert decoded[:3] == [2, 2, 2] and set(decoded[3:]) == {1}, decoded  # not 2 until the batch ends


@pytest.mark.parametrize("with_states", [True, False])  # without: the nuggets are read through the layout's mask
def test_rows_that_finish_or_leave_drop_out_of_the_batch(setup, widths, monkeypatch, with_states):
    model, states, prompts = setup
    settings = GenerationSettings(max_new_tokens=6)
    eos, real, steps = min(eos_ids(model)), generation.next_token, itertools.count()

    def row_0_ends_at_step_1(logits, settings, generator):
        tokens = real(logits, settings, generator)
        if next(steps) == 1:
            tokens[0] = eos
        return tokens

    monkeypatch.setattr(generation, "next_token", row_0_ends_at_step_1)
    samples = [[states[0]], [states[1]], [states[2]]] if with_states else [[states[0]], [], [states[2]]]
    leave: set[int] = set()
    texts, ends = ["", "", ""], []
    for step, (pieces, done) in enumerate(generation_steps(model, samples, prompts[:3], settings, leave=leave)):
        texts = [t + p for t, p in zip(texts, pieces)]
        ends.append(done)
        if step == 2:
            leave.add(1)  # cancelled after its third step
    assert widths == [3, 3, 2, 1, 1, 1] and ends[1] == ["stop", None, None] and ends[-1] == ["stop", None, "length"]
    monkeypatch.setattr(generation, "next_token", real)
    alone = generate(model, [samples[2]], [prompts[2]], settings)[0]
    assert texts[2] == alone  # the rows around it left without changing its answer


def test_a_bad_row_fails_alone(setup):
    model, states, prompts = setup
    settings = GenerationSettings(max_new_tokens=4)
    batcher = BatchedGenerator(model, max_batch=8, wait_s=0.2)
    good = batcher.stream([states[0]], prompts[0], settings)
    bad = batcher.stream([states[1]], [5] * 600, settings)  # longer than the tiny model's 512 positions
    with pytest.raises(ValueError, match="positions"):
        list(bad)
    assert "".join(good) == generate(model, [[states[0]]], [prompts[0]], settings)[0]


def test_requests_arriving_during_a_batch_gather_into_the_next(setup):
    model, states, prompts = setup
    settings = GenerationSettings(max_new_tokens=12)
    batcher = BatchedGenerator(model, max_batch=8, wait_s=0.01)
    first = batcher.stream([states[0]], prompts[0], settings)
    next(first)  # the first batch decodes now
    later = [batcher.stream([s], p, settings) for s, p in zip(states[1:], prompts[1:])]
    for row in [first, *later]:
        list(row)
    assert batcher.batch_sizes == [1, 3]

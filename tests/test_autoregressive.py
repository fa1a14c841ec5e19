"""Autoregressive mode (paper Sec. 2.2) on the tiny model."""

import pytest
import torch
from pydantic import ValidationError
from tiny import tiny_base, tiny_tokenizer

from nugget_rag.config import DECODER, ENCODER, NuggetConfig
from nugget_rag.generation import GenerationSettings
from nugget_rag.generation.autoregressive import NuggetStream, StreamSettings, TextChunks, calibrate_threshold
from nugget_rag.model import NuggetModel

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.")
PLAIN = {"encoder": None, "decoder": None}  # adapters off


@pytest.mark.parametrize("window,segment", [(8, 8), (0, 5), (12, 7)])
def test_r1_without_adapters_equals_the_base_model(make_model, doc_ids, window, segment):
    model, ids = make_model(ratio=1), doc_ids(TEXT)
    stream = NuggetStream(model, window=window, segment=segment, **PLAIN)
    with torch.no_grad():
        logits = stream.feed(ids, return_logits=True)
        expected = tiny_base().model(torch.tensor([ids])).logits[0]
    assert len(stream.nugget_ids) == stream.n - len(stream.open_ids)  # every token of every closed segment kept
    assert (logits - expected).abs().max() < 1e-4


def test_feeding_in_pieces_equals_feeding_at_once(make_model, doc_ids):
    model, ids = make_model(ratio=3), doc_ids(TEXT)
    with torch.no_grad():
        whole = NuggetStream(model, window=6, segment=9).feed(ids, return_logits=True)
        stream = NuggetStream(model, window=6, segment=9)
        pieces = [stream.feed(ids[i : i + n], return_logits=True)
                  for i, n in zip(range(0, len(ids), 4), [4] * 100)]
    assert (torch.cat(pieces) - whole).abs().max() < 1e-4


def test_the_past_is_read_through_nuggets_only(make_model, doc_ids):
    """Beyond the window, a token reads the nuggets: changing what was compressed changes the prediction, and at
    r > 1 it differs from the uncompressed model."""
    model, ids = make_model(ratio=4), doc_ids(TEXT)
    with torch.no_grad():
        stream = NuggetStream(model, window=8, segment=8)
        logits = stream.feed(ids, return_logits=True)
        full = NuggetStream(model, window=8, segment=8, ratio=1).feed(ids, return_logits=True)
    assert stream.kv_size < stream.n
    assert (logits[:16] - full[:16]).abs().max() < 1e-5  # the first two segments read no nuggets
    assert (logits[-8:] - full[-8:]).abs().max() > 1e-3


def test_a_text_three_times_the_positions_runs_with_bounded_memory(doc_ids, monkeypatch):
    model = NuggetModel(tiny_base(max_positions=64), NuggetConfig(ratio=2, scorer_layer=2, lora={"rank": 4}))
    ids = (doc_ids(TEXT) * 2)[:200]  # > 3 x 64 positions
    stream = NuggetStream(model, window=16, segment=16)
    seen = {"position": 0, "keys": 0}
    run = model.run

    def watched(adapter, nuggets=None, **inputs):
        seen["position"] = max(seen["position"], int(inputs["position_ids"].max()))
        seen["keys"] = max(seen["keys"], nuggets.keys.shape[3] + inputs["input_ids"].shape[1])
        return run(adapter, nuggets, **inputs)

    monkeypatch.setattr(model, "run", watched)
    sizes = []
    with torch.no_grad():
        for i in range(0, len(ids), 10):
            stream.feed(ids[i : i + 10])
            sizes.append(stream.nuggets.keys.numel() + stream.decoder_window.keys.numel())
    assert stream.n == 200 and stream.dropped > 0
    assert stream.max_nuggets == 64 - 16 - 16
    assert seen["position"] < 64 and seen["keys"] <= 64
    assert max(sizes) == max(sizes[len(sizes) // 2 :])  # stops growing once the cap is reached
    assert int(stream.visible.sum()) <= stream.max_nuggets


def test_generation_continues_like_the_base_model_at_r1(make_model, doc_ids):
    model, ids = make_model(ratio=1), doc_ids("The quick brown fox")
    stream = NuggetStream(model, window=4, segment=4, **PLAIN)
    stream.feed(ids)
    text = "".join(stream.generate(GenerationSettings(max_new_tokens=12)))
    base = tiny_base().model
    out = base.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert text == tiny_tokenizer().decode(out[0, len(ids):], skip_special_tokens=True)
    assert stream.n == len(ids) + 12  # what it generated is read too: the stream can go on


def test_threshold_selection_and_its_calibration(make_model, doc_ids):
    model, ids = make_model(ratio=4), doc_ids(TEXT)
    threshold = calibrate_threshold(model, [ids], ratio=4)
    with torch.no_grad():
        stream = NuggetStream(model, window=8, segment=8, threshold=threshold)
        stream.feed(ids)
        silent = NuggetStream(model, window=8, segment=8, threshold=1e9)  # keeps nothing: the last tokens remain
        silent.feed(ids)
    closed = stream.n - len(stream.open_ids)
    assert 0.1 < len(stream.nugget_ids) / closed < 0.5
    assert silent.nugget_positions.tolist() == list(range(7, closed, 8))


def test_gradients_reach_both_adapters_and_the_scorer(make_model, doc_ids):
    model, ids = make_model(ratio=3), doc_ids(TEXT)
    stream = NuggetStream(model, window=8, segment=8)
    logits = stream.feed(ids, return_logits=True)
    torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).backward()
    for adapter in (ENCODER, DECODER):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.adapter_parameters(adapter))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.scorer.parameters())


def test_state_export_matches_the_nuggets_kept(make_model, doc_ids):
    model, ids = make_model(ratio=4), doc_ids(TEXT)
    stream = NuggetStream(model, window=8, segment=8)
    with torch.no_grad():
        stream.feed(ids)
        stream.flush()
        state = stream.to_state()
    assert state.n == len(ids) and state.k == len(stream.nugget_ids) and state.positions[-1] == len(ids) - 1
    assert state.fingerprint.startswith(model.state_tag("autoregressive:"))


def test_text_chunks_add_up_to_the_whole_texts_ids(doc_ids):
    tok = tiny_tokenizer()
    text = "naïve café — déjà vu.  Twice  spaced\nlines"
    data = text.encode()
    chunks = TextChunks(tok)
    ids = [i for c in (data[k : k + 3] for k in range(0, len(data), 3)) for i in chunks.add(c)] + chunks.finish()
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    broken = TextChunks(tok)
    broken.add("é".encode()[:1])
    with pytest.raises(ValueError, match="inside a UTF-8 character"):
        broken.finish()


def test_bad_settings_and_inputs_get_clear_errors(make_model):
    model = make_model()
    with pytest.raises(ValidationError, match="window"):
        StreamSettings(window=-1)
    with pytest.raises(ValueError, match="window=600 and segment=600 tokens take more than the model's 512"):
        NuggetStream(model, window=600)
    with pytest.raises(ValueError, match="use max_nuggets <= 480"):
        NuggetStream(model, window=16, segment=16, max_nuggets=1000)
    with pytest.raises(ValidationError, match="ratio must be a finite number >= 1"):
        StreamSettings(ratio=0.5)
    with pytest.raises(ValueError, match="the text is empty"):
        NuggetStream(model).read(["", "   "[:0]])
    with pytest.raises(ValueError, match="nothing read yet"):
        next(NuggetStream(model).generate())
    with pytest.raises(TypeError, match="str or bytes"):
        NuggetStream(model).read([3])

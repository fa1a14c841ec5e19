"""The fused decoder attention (bias in an extra channel, no float mask) against the float-mask reference."""

import pytest
import torch

from nugget_rag.model import attention
from nugget_rag.model.attention import BiasChannelNuggets, ReadNuggets

DOCS = ["The quick brown fox jumps over the lazy dog, then naps.", "Paris is the capital of France.",
        "Rivers run to the sea and the sea never fills."]
TARGETS = ["Where does the fox jump, and when?", "Which city is the capital?"]


def _right_padded(doc_ids, texts):
    rows = [doc_ids(t) for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    return ids, mask


def _step(model, doc_ids, attention: str, layout: list[list[int]], checkpointing: bool = False):
    """Loss and every gradient of one training step whose samples read the documents listed in `layout`."""
    model.attention = attention
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    model.zero_grad()
    states = model.compress([doc_ids(d) for d in DOCS])
    ids, mask = _right_padded(doc_ids, TARGETS)
    labels = ids.masked_fill(~mask, -100)
    out = model.decode([[states[i] for i in docs] for docs in layout], ids, token_mask=mask, labels=labels,
                       soft_prompt=True)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", [[[0], [1]], [[0, 2], [2, 1, 0]]], ids=["one document", "several composed"])
def test_fused_attention_equals_the_reference_in_loss_and_every_gradient(make_model, doc_ids, monkeypatch, layout):
    calls = []
    attend = BiasChannelNuggets.attend
    monkeypatch.setattr(BiasChannelNuggets, "attend", lambda self, *a: calls.append(1) or attend(self, *a))
    loss, grads = _step(make_model(ratio=3), doc_ids, "reference", layout)
    assert not calls
    fused_loss, fused_grads = _step(make_model(ratio=3), doc_ids, "fused", layout)
    assert len(calls) == make_model().llama.config.num_hidden_layers  # every layer of the decoder pass
    torch.testing.assert_close(fused_loss, loss, atol=1e-6, rtol=1e-6)
    assert grads.keys() == fused_grads.keys()
    assert any(name.startswith("scorer.") for name in grads) and any("lora_" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert all(float(g.abs().sum()) > 0 for n, g in fused_grads.items() if n.startswith("scorer."))


def test_fused_attention_keeps_nuggets_under_gradient_checkpointing(make_model, doc_ids):
    layout = [[0, 2], [1]]
    loss, grads = _step(make_model(ratio=3), doc_ids, "reference", layout)
    fused_loss, fused_grads = _step(make_model(ratio=3), doc_ids, "fused", layout, checkpointing=True)
    torch.testing.assert_close(fused_loss, loss, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_fused_reader_needs_right_padding_and_one_pass():
    right = torch.tensor([[True, True, False], [True, True, True]])
    left = torch.tensor([[False, True, True], [True, True, True]])
    assert BiasChannelNuggets.fits(right, 3)
    assert not BiasChannelNuggets.fits(left, 3)  # generation's prompts are left-padded
    assert not BiasChannelNuggets.fits(right, 1)  # a decoding step over a KV cache
    keys = torch.zeros(1, 2, 1, 4, 8)
    with pytest.raises(ValueError, match="right-padded"):
        BiasChannelNuggets(keys, keys, torch.zeros(2, 4), left, 3)


def test_a_nonfinite_bias_is_refused_and_padding_never_carries_inf():
    keys = torch.zeros(1, 2, 1, 3, 8)
    mask = torch.ones(2, 2, dtype=torch.bool)
    padded = torch.tensor([[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]])
    reader = BiasChannelNuggets(keys, keys, padded, mask, 2)
    assert torch.isfinite(reader.channel).all() and reader.channel.min() == BiasChannelNuggets.PADDING_BIAS
    with pytest.raises(ValueError, match="not finite"):
        BiasChannelNuggets(keys, keys, torch.tensor([[0.0, float("nan"), 0.0], [0.0, 0.0, 0.0]]), mask, 2)


def test_left_padded_tokens_under_fused_attention_are_read_under_the_mask(make_model, doc_ids, monkeypatch):
    from nugget_rag.model.layout import NuggetLayout

    model = make_model(ratio=2)
    with torch.no_grad():
        states = model.compress([doc_ids(d) for d in DOCS])
    ids, mask = model.pad([doc_ids(TARGETS[0]), doc_ids("Why?")], left=True)  # as generation pads its prompts
    samples = [[states[0]], [states[1], states[2]]]
    with torch.no_grad():
        reference = model.decode(samples, ids, token_mask=mask).logits
        readers = []
        reader = NuggetLayout.reader
        monkeypatch.setattr(NuggetLayout, "reader", lambda self, *a: readers.append(reader(self, *a)) or readers[-1])
        model.attention = "fused"
        fused = model.decode(samples, ids, token_mask=mask).logits
    assert [type(r) for r in readers] == [ReadNuggets]
    torch.testing.assert_close(fused[mask], reference[mask], atol=0, rtol=0)


@pytest.mark.parametrize("precision", ["bf16 weights", "bf16 autocast"])
def test_reading_nuggets_under_bf16_gives_the_float32_logits(make_model, doc_ids, monkeypatch, precision):
    """Evaluation and generation on a GPU: bf16 weights (`nugget-rag eval`), or float32 weights under autocast (the
    trainer's dev scoring); both readers, CUDA's causal flag forced. The logits match float32's within bf16's
    precision."""
    monkeypatch.setattr(attention, "takes_causal_flag", lambda device: True)
    model = make_model(ratio=3).eval()
    ids, mask = _right_padded(doc_ids, TARGETS)
    with torch.no_grad():
        states = model.compress([doc_ids(d) for d in DOCS])
        expected = model.decode([[states[0], states[2]], [states[1]]], ids, token_mask=mask).logits
        for reader in ("reference", "fused"):
            model.attention = reader
            model.to(torch.bfloat16 if precision == "bf16 weights" else torch.float32)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16 autocast"):
                low = model.compress([doc_ids(d) for d in DOCS])
                logits = model.decode([[low[0], low[2]], [low[1]]], ids, token_mask=mask).logits
            model.to(torch.float32)
            real = mask[..., None].expand_as(expected)
            error = (logits.float() - expected)[real].norm() / expected[real].norm()
            assert error < 0.1, (reader, float(error))  # a wrong mask or dtype is off by O(1)

"""The nugget engine's mechanics on a tiny random LLaMA."""

import copy
import logging
import math
import threading

import pytest
import torch
from safetensors import safe_open
from tiny import tiny_base

from nugget_rag.config import DECODER, ENCODER, NuggetConfig
from nugget_rag.generation import GenerationSettings, generate, stream_generate
from nugget_rag.model import NuggetModel
from nugget_rag.model.attention import rotate_keys
from nugget_rag.model.checkpoint_files import WEIGHTS_FILE
from nugget_rag.model.int8 import MAX_INT8_ROWS, Int8Linear

DOC = "The quick brown fox jumps over the lazy dog, then naps."
DOC2 = "Paris is the capital of France."
PROMPT = "Where does the fox jump?"


def test_r1_without_adapters_equals_base_model_on_concatenation(make_model, doc_ids):
    model = make_model(ratio=1, placement="before_prompt")  # nuggets first: the raw concatenation
    reference = tiny_base().model
    doc, prompt = doc_ids(DOC), doc_ids(PROMPT)
    with torch.no_grad():
        states = model.compress([doc], adapter=None)
        logits = model.decode([states], torch.tensor([prompt]), adapter=None).logits
    expected = reference(torch.tensor([doc + prompt])).logits[:, len(doc):]
    assert states[0].k == len(doc)
    assert (logits - expected).abs().max() < 1e-4


def test_plain_forwards_of_the_wrapped_base_model_are_unchanged(make_model):
    """The nugget attention is installed on the shared base model; without nuggets it must still honour padding
    masks and KV caches exactly as the unwrapped model does."""
    model, reference = make_model(), tiny_base().model
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad(), model.use_adapter(None):
        padded = model.llama(input_ids=ids, attention_mask=mask).logits
        expected = reference(input_ids=ids, attention_mask=mask).logits
        cached = model.llama(input_ids=ids[:, :3], use_cache=True).past_key_values
        chunk = model.llama(input_ids=ids[:, 3:], past_key_values=cached).logits
        cached = reference(input_ids=ids[:, :3], use_cache=True).past_key_values
        expected_chunk = reference(input_ids=ids[:, 3:], past_key_values=cached).logits
    assert (padded - expected)[mask.bool()].abs().max() < 1e-5
    assert (chunk - expected_chunk).abs().max() < 1e-5


def test_adapters_change_the_output(make_model, doc_ids):
    model = make_model(ratio=1)
    doc, prompt = doc_ids(DOC), doc_ids(PROMPT)
    with torch.no_grad():
        states = model.compress([doc], adapter=None)
        plain = model.decode([states], torch.tensor([prompt]), adapter=None).logits
        tuned = model.decode([states], torch.tensor([prompt]), adapter=DECODER).logits
    assert (plain - tuned).abs().max() > 1e-3


@pytest.mark.parametrize("ratio", [1, 2.5, 4, 10, 1000])
def test_nugget_count_last_token_and_order(make_model, doc_ids, ratio):
    model = make_model(ratio=ratio)
    docs = [doc_ids(DOC), doc_ids(DOC2), doc_ids("x")]
    with torch.no_grad():
        states = model.compress(docs)
    for state, doc in zip(states, docs):
        positions = state.positions.tolist()
        assert state.n == len(doc)
        assert state.k == math.ceil(len(doc) / ratio)
        assert positions[-1] == len(doc) - 1
        assert positions == sorted(set(positions))
        assert state.keys.shape[2] == state.values.shape[2] == state.k == len(state.tokens)


def test_selection_follows_the_scores(make_model, doc_ids):
    model = make_model(ratio=4)
    doc = doc_ids(DOC)
    with torch.no_grad():
        input_ids, opening = model.encoder_input([doc])  # the document after the template's opening
        scores = model.score(input_ids)[0, opening:]
        state = model.compress([doc])[0]
    k = state.k
    expected = sorted(scores[:-1].topk(k - 1).indices.tolist() + [len(doc) - 1])
    assert state.positions.tolist() == expected


def test_batch_compression_equals_one_by_one(make_model, doc_ids):
    model = make_model(ratio=3)
    docs = [doc_ids(DOC), doc_ids(DOC2), doc_ids("Short.")]
    with torch.no_grad():
        together = model.compress(docs)
        alone = [model.compress([d])[0] for d in docs]
    for a, b in zip(together, alone):
        assert a.positions.tolist() == b.positions.tolist()
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)
        assert a.fingerprint == b.fingerprint


def test_documents_compose_in_both_orders_deterministically(make_model, doc_ids):
    model = make_model(ratio=2)
    prompt = torch.tensor([doc_ids(PROMPT)])
    with torch.no_grad():
        a, b = model.compress([doc_ids(DOC), doc_ids(DOC2)])
        ab = model.decode([[a, b]], prompt).logits
        ba = model.decode([[b, a]], prompt).logits
        assert torch.equal(ab, model.decode([[a, b]], prompt).logits)
        assert torch.equal(ba, model.decode([[b, a]], prompt).logits)
        batched = model.decode([[a, b], [b, a]], torch.cat([prompt, prompt])).logits
    assert torch.isfinite(ab).all() and torch.isfinite(ba).all()
    assert (ab - ba).abs().max() > 1e-4  # order is information the decoder sees
    torch.testing.assert_close(batched[0], ab[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(batched[1], ba[0], atol=1e-5, rtol=1e-4)


def test_r1_two_documents_equal_base_model_on_concatenation(make_model, doc_ids):
    """Renumbering rotates keys exactly: two documents read as if they had been one text."""
    model = make_model(ratio=1, placement="before_prompt")  # nuggets first: the raw concatenation
    reference = tiny_base().model
    d1, d2, prompt = doc_ids(DOC), doc_ids(DOC2), doc_ids(PROMPT)
    with torch.no_grad():
        s1 = model.compress([d1], adapter=None)[0]
        s_joint = model.compress([d1 + d2], adapter=None)[0]
        logits = model.decode([[s_joint]], torch.tensor([prompt]), adapter=None).logits
    expected = reference(torch.tensor([d1 + d2 + prompt])).logits[:, len(d1 + d2):]
    assert (logits - expected).abs().max() < 1e-4
    assert s1.k == len(d1)


def _train_step(model, doc_ids, soft_prompt=False):
    docs = [doc_ids(DOC), doc_ids(DOC2)]
    states = model.compress(docs)
    target = torch.tensor([doc_ids(PROMPT)] * 2)
    return model.decode([[states[0]], [states[1], states[0]]], target, labels=target, soft_prompt=soft_prompt)


def test_scores_do_not_change_the_forward_pass(make_model, doc_ids):
    """Scores enter only as s - s.detach(): with gradients live, a shift of every score changes nothing."""
    model = make_model(ratio=3)
    model.train()
    reference = _train_step(model, doc_ids).logits
    with torch.no_grad():
        model.scorer.net[-1].bias.add_(5.0)  # shifts every score, keeps their order
    shifted = _train_step(model, doc_ids)
    assert shifted.logits.requires_grad
    torch.testing.assert_close(reference, shifted.logits, atol=0, rtol=0)


def test_every_trained_part_gets_gradients(make_model, doc_ids):
    model = make_model(ratio=3)
    model.train()
    out = _train_step(model, doc_ids, soft_prompt=True)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.scorer.parameters())
    assert model.soft_prompt.grad is not None and model.soft_prompt.grad.abs().sum() > 0
    for adapter in (ENCODER, DECODER):
        grads = [p.grad for p in model.adapter_parameters(adapter)]
        assert grads and all(g is not None for g in grads), adapter
        assert sum(float(g.abs().sum()) for g in grads) > 0, adapter
    frozen = [p for n, p in model.llama.named_parameters() if "lora_" not in n]
    assert all(p.grad is None and not p.requires_grad for p in frozen)


def test_frozen_parts_get_no_gradient(make_model, doc_ids):
    model = make_model(ratio=3)
    model.set_trainable(encoder=True, decoder=False, scorer=True, soft_prompt=False)
    model.train()
    _train_step(model, doc_ids).loss.backward()
    assert all(p.grad is None for p in model.adapter_parameters(DECODER))
    assert all(p.grad is not None for p in model.adapter_parameters(ENCODER))


def _loss_and_gradients(model: NuggetModel, doc_ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad()
    out = _train_step(model, doc_ids, soft_prompt=True)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(a, b, atol: float, rtol: float) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=atol, rtol=rtol, msg=name)


def test_gradient_checkpointing_keeps_nuggets_and_gradients(make_model, doc_ids):
    plain, checkpointed = make_model(ratio=3), make_model(ratio=3)
    checkpointed.enable_gradient_checkpointing()
    _assert_same_step(_loss_and_gradients(plain, doc_ids), _loss_and_gradients(checkpointed, doc_ids), 1e-5, 1e-3)


def test_save_and_load_give_identical_outputs(make_model, doc_ids, tmp_path):
    model = make_model(ratio=3)
    with torch.no_grad():
        model.scorer.net[0].weight.add_(0.5)
        model.soft_prompt.add_(1.0)
    model.save_pretrained(tmp_path)
    loaded = NuggetModel.from_pretrained(tmp_path, base_model=tiny_base())
    prompt = [doc_ids(PROMPT)]
    outputs = []
    for m in (model, loaded):
        with torch.no_grad():
            states = m.compress([doc_ids(DOC)])
            outputs.append((states[0].fingerprint, m.decode([states], torch.tensor(prompt), soft_prompt=True).logits,
                            generate(m, [states], prompt, GenerationSettings(max_new_tokens=8))))
    assert outputs[0][0] == outputs[1][0]
    assert torch.equal(outputs[0][1], outputs[1][1])
    assert outputs[0][2] == outputs[1][2]
    assert loaded.config == model.config


def test_bfloat16_export_is_half_the_size_and_loads_the_rounded_weights(make_model, tmp_path):
    model = make_model(ratio=3)
    full, half = model.save_pretrained(tmp_path / "fp32"), model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    with safe_open(full / WEIGHTS_FILE, "pt") as f32, safe_open(half / WEIGHTS_FILE, "pt") as b16:
        assert f32.keys() == b16.keys()
        assert {b16.get_tensor(k).dtype for k in b16.keys()} == {torch.bfloat16}
    loaded = NuggetModel.from_pretrained(half, base_model=tiny_base())
    assert loaded.dtype == model.dtype
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        if a.requires_grad or "lora_" in name:
            torch.testing.assert_close(b, a.to(torch.bfloat16).to(a.dtype), atol=0, rtol=0, msg=name)


def test_checkpoint_refuses_another_base_model(make_model, tmp_path):
    make_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="base model"):
        NuggetModel.from_pretrained(tmp_path, base_model=tiny_base(seed=7))


def test_fingerprint_tracks_what_produces_nuggets(make_model):
    model = make_model(ratio=4)
    first = model.fingerprint()
    assert model.fingerprint(ratio=5) != first
    with torch.no_grad():
        next(model.adapter_parameters(DECODER)).add_(1.0)
    assert model.fingerprint() == first  # the decoder does not shape nuggets
    with torch.no_grad():
        next(model.adapter_parameters(ENCODER)).add_(1.0)
    second = model.fingerprint()
    assert second != first
    scorer_weight = next(model.scorer.parameters())
    scorer_weight.data = scorer_weight.data + 1.0  # replaced, not changed in place: the cached digest must not stick
    assert model.fingerprint() not in (first, second)
    assert make_model(ratio=4, perturb_adapters=False).fingerprint() == make_model(ratio=4, perturb_adapters=False).fingerprint()
    # documents encoded after the template's opening are other states than documents encoded alone
    assert make_model(ratio=4).fingerprint() != make_model(ratio=4, placement="before_prompt").fingerprint()


def test_training_states_skip_the_weights_digest_and_are_never_stored(make_model, doc_ids, monkeypatch):
    """A training pass's weights change every step: hashing them into each state would cost a device-to-host copy
    of the encoder adapter per micro-batch. Its states equal the identified ones but cannot be stored."""
    from nugget_rag.model import identity
    from nugget_rag.state.store import NuggetStore

    model = make_model(ratio=4)
    doc = doc_ids(DOC)
    identified = model.compress([doc])[0]
    monkeypatch.setattr(identity, "weights_digest", lambda named: pytest.fail("hashed the weights"))
    with torch.no_grad():
        next(model.adapter_parameters(ENCODER)).add_(0.0)  # an optimiser step: the cached digest is stale
    transient = model.compress([doc], identify=False)[0]
    assert torch.equal(transient.keys, identified.keys) and torch.equal(transient.values, identified.values)
    assert transient.fingerprint.endswith(":unidentified")
    with pytest.raises(ValueError, match="training pass"):
        NuggetStore().put(DOC, transient)


def test_fingerprint_names_the_adapter_lora_settings_and_segments(make_model, doc_ids):
    """States compressed without the adapter, under another LoRA scaling or in other segments are other states."""
    model = make_model(ratio=4)
    doc = doc_ids(DOC)
    with torch.no_grad():
        tuned, plain = model.compress([doc])[0], model.compress([doc], adapter=None)[0]
        cut = model.compress([doc], segment_tokens=5)[0]
    assert len({tuned.fingerprint, plain.fingerprint, cut.fingerprint}) == 3
    assert model.fingerprint(segment_tokens=10**6) == tuned.fingerprint  # capped at the model's room: the default
    alpha = NuggetModel(tiny_base(), NuggetConfig(ratio=4, scorer_layer=2, lora={"rank": 4, "alpha": 4}))
    alpha.load_state_dict(model.state_dict())  # the same weights, another LoRA scaling
    assert alpha.fingerprint() != model.fingerprint()


def test_generation_matches_transformers_generate(make_model, doc_ids):
    model = make_model(ratio=1, placement="before_prompt")  # nuggets first: the raw concatenation
    reference = tiny_base().model
    d1, d2, prompt = doc_ids(DOC), doc_ids(DOC2), doc_ids(PROMPT)
    with torch.no_grad():
        s1, s2 = model.compress([d1, d2], adapter=None)
    texts = generate(model, [[s1], [s2, s1]], [prompt, prompt[:5]], GenerationSettings(max_new_tokens=10), adapter=None)
    for text, ids in zip(texts, [d1 + prompt, d2 + d1 + prompt[:5]]):
        out = reference.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
        expected = model.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        assert text == expected


def test_generation_from_a_prefilled_cache_equals_the_nugget_mask_path(make_model, doc_ids, monkeypatch):
    """Nuggets as the first entries of a DynamicCache (standard attention) give the hidden states of every step that
    the nugget mask gives; rows of different nugget counts and prompt lengths (padding on both sides)."""
    from nugget_rag.generation import decoding as generation

    model = make_model()
    with torch.no_grad():
        s1, s2 = model.compress([doc_ids(DOC), doc_ids(DOC2)])
    run = model.run

    def steps(prefill, samples, prompts) -> list[torch.Tensor]:
        hidden = []
        monkeypatch.setattr(generation, "prefill_nuggets", prefill)
        monkeypatch.setattr(model, "run", lambda *a, **k: hidden.append(run(*a, **k)) or hidden[-1])
        generate(model, samples, prompts, GenerationSettings(max_new_tokens=8))
        return hidden[-8:]  # the first call also runs the prompt opening once (PrefixCache)

    for samples, prompts in [([[s1], [s2, s1]], [doc_ids(PROMPT), doc_ids(PROMPT)[:5]]),  # padded: a 2-D mask
                             ([[s2, s1]], [doc_ids(PROMPT)])]:  # one row: no mask at all
        fast = steps(generation.prefill_nuggets, samples, prompts)
        slow = steps(lambda layout, mask: None, samples, prompts)
        real = model.pad(prompts, left=True)[1]
        assert (fast[0][real] - slow[0][real]).abs().max() < 1e-4  # real tokens of the prompt pass
        assert all((f - s).abs().max() < 1e-4 for f, s in zip(fast[1:], slow[1:]))


def test_repetition_settings_act_on_the_generated_text(make_model, doc_ids):
    model = make_model()
    with torch.no_grad():
        (state,) = model.compress([doc_ids(DOC)])
    prompts = [doc_ids(PROMPT), doc_ids(PROMPT)[:3]]

    def run(**settings) -> list[str]:
        return generate(model, [[state], [state]], prompts, GenerationSettings(max_new_tokens=30, **settings))

    def bigrams(text: str) -> list[str]:  # the tiny tokenizer has a token a character
        return [text[i : i + 2] for i in range(len(text) - 1)]

    plain, no_repeat, penalised = run(), run(no_repeat_ngram_size=2), run(repetition_penalty=1e4)
    assert any(len(set(bigrams(t))) < len(bigrams(t)) for t in plain)  # the random tiny model loops
    assert all(len(set(bigrams(t))) == len(bigrams(t)) for t in no_repeat)
    assert all(len(set(t)) == len(t) for t in penalised)
    assert [t[0] for t in penalised] == [t[0] for t in plain]  # the prompt's tokens are not penalised


def test_finish_sentence_runs_past_the_limit_to_the_sentences_end(make_model, doc_ids, monkeypatch):
    model = make_model()
    with torch.no_grad():
        (state,) = model.compress([doc_ids(DOC)])
    script = doc_ids("It naps. It costs 3.5 euros. The end")  # the tokens the model is made to say
    said = iter([])

    def scripted(hidden):
        logits = torch.zeros(hidden.shape[0], len(model.tokenizer))
        logits[:, next(said)] = 1.0
        return logits

    monkeypatch.setattr(model, "logits", scripted)

    def run(max_new_tokens: int, finish_sentence: int) -> str:
        nonlocal said
        said = iter(script)
        settings = GenerationSettings(max_new_tokens=max_new_tokens, finish_sentence=finish_sentence)
        return generate(model, [[state]], [doc_ids(PROMPT)], settings)[0]

    assert run(11, 0) == "It naps. It"  # a hard limit cuts mid-sentence
    assert run(11, 30) == "It naps. It costs 3.5 euros."  # a decimal point is not a sentence's end
    assert run(11, 5) == "It naps. It cost"  # at most finish_sentence tokens more
    assert run(8, 30) == "It naps."  # a limit at a sentence's end costs nothing more
    script = doc_ids("It naps. It is\nlong. It\n\nends")
    assert run(11, 30) == "It naps. It is\nlong."  # a line wrapped in its sentence goes on
    assert run(22, 30) == "It naps. It is\nlong. It\n\n"  # a blank line ends one


def test_bad_inputs_get_clear_errors(make_model, doc_ids):
    model = make_model()
    with pytest.raises(ValueError, match="at least one token"):
        model.compress([[]])
    with pytest.raises(ValueError, match="ratio"):
        NuggetConfig(ratio=0.5)
    with pytest.raises(ValueError, match="ratio"):
        NuggetConfig(ratio="ten")
    with pytest.raises(ValueError, match="positions"):
        model.decode([[]], torch.tensor([[5] * (model.max_positions + 1)]))


def test_long_documents_are_compressed_in_segments_that_compose(make_model, doc_ids):
    model = make_model(ratio=1)
    doc, prompt = doc_ids(DOC + " " + DOC2), doc_ids(PROMPT)
    with torch.no_grad():
        whole = model.compress([doc], adapter=None)[0]
        segmented = model.compress([doc], adapter=None, segment_tokens=20)[0]
        long_state = model.compress([[7] * (model.max_positions + 30)], ratio=4)[0]
    assert segmented.n == len(doc) and segmented.positions.tolist() == list(range(len(doc)))
    assert long_state.n == model.max_positions + 30 and long_state.positions[-1] == long_state.n - 1
    assert long_state.k == math.ceil(model.max_positions / 4) + math.ceil(30 / 4)
    # The first segment is read exactly as the base model reads those tokens alone.
    torch.testing.assert_close(segmented.keys[:, :, :20], whole.keys[:, :, :20], atol=1e-5, rtol=1e-4)
    assert (segmented.keys[:, :, 20:] - whole.keys[:, :, 20:]).abs().max() > 1e-3  # later segments lack context
    with torch.no_grad():
        logits = model.decode([[segmented]], torch.tensor([prompt]), adapter=None).logits
    assert torch.isfinite(logits).all()


def test_untrained_model_is_the_same_in_every_process():
    """LoRA and Scorer start from the config's seed, so a store written by one process serves the next."""
    fingerprints = []
    for global_seed in (1, 2):
        base = tiny_base()
        torch.manual_seed(global_seed)
        state = torch.random.get_rng_state()
        fingerprints.append(NuggetModel(base, NuggetConfig(scorer_layer=2)).fingerprint())
        assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random stream is untouched
    assert fingerprints[0] == fingerprints[1]
    assert NuggetModel(tiny_base(), NuggetConfig(scorer_layer=2, seed=1)).fingerprint() != fingerprints[0]


def test_default_checkpoint_is_the_shipped_one_only_on_the_default_model(make_model, tmp_path, monkeypatch):
    import nugget_rag.model.checkpoint_files as checkpoint_files
    from nugget_rag.model.base_model import DEFAULT_MODEL_NAME, BaseLM

    monkeypatch.setattr(checkpoint_files, "SHIPPED_CHECKPOINT", tmp_path / "missing")
    assert checkpoint_files.default_checkpoint_for(None) is None  # nothing shipped: untrained
    trained = make_model(ratio=3)
    with torch.no_grad():
        trained.scorer.net[0].weight.add_(0.5)
    trained.save_pretrained(tmp_path / "shipped")
    monkeypatch.setattr(checkpoint_files, "SHIPPED_CHECKPOINT", tmp_path / "shipped")
    assert checkpoint_files.default_checkpoint_for(None) == tmp_path / "shipped"
    assert checkpoint_files.default_checkpoint_for("/models/other-llama") is None
    # another base model gets fresh adapters; the default model (by name) gets the shipped ones
    fresh = NuggetModel.from_pretrained(base_model=tiny_base())
    assert fresh.fingerprint() == NuggetModel(tiny_base()).fingerprint() != trained.fingerprint()
    base = tiny_base()
    named = BaseLM(model=base.model, tokenizer=base.tokenizer, name=DEFAULT_MODEL_NAME)
    assert NuggetModel.from_pretrained(base_model=named).fingerprint() == trained.fingerprint()
    assert NuggetModel.from_pretrained(None, base_model=tiny_base()).config.ratio == NuggetConfig().ratio


def test_chat_prompt_puts_the_nuggets_where_fulls_prompt_has_the_documents(make_model):
    from nugget_rag.prompts import chat_text, chat_token_ids, full_context_messages

    model, legacy = make_model(), make_model(placement="before_prompt")
    tok, chat = model.tokenizer, [{"role": "user", "content": PROMPT}]
    before, after = model.chat_prompt(chat)
    assert tok.decode(before) + DOC + tok.decode(after) == chat_text(tok, full_context_messages([DOC], PROMPT))
    assert tok.decode(before).endswith("user\n") and tok.decode(after).startswith("\n\n" + PROMPT)
    assert legacy.chat_prompt(chat) == ([], chat_token_ids(tok, chat))
    with pytest.raises(ValueError, match="user turn"):
        model.chat_prompt([{"role": "system", "content": "hi"}])


def test_prompt_prefix_is_the_decoders_own_pass_before_the_nuggets(make_model, doc_ids):
    """A prefix reads exactly like an r = 1 state of its text made by the decoder adapter, put first."""
    model = make_model(ratio=3, placement="before_prompt")  # no document opening: compress runs the text alone
    prefix, doc, prompt = doc_ids("System: be brief. User: "), doc_ids(DOC), doc_ids(PROMPT)
    with torch.no_grad():
        state = model.compress([doc])[0]
        as_state = {a: model.compress([prefix], ratio=1, adapter=a)[0] for a in (DECODER, None)}
        read = model.decode([[state], [state]], torch.tensor([prompt] * 2), prefixes=[prefix, []]).logits
        expected = model.decode([[as_state[DECODER], state]], torch.tensor([prompt]), prefixes=[[]]).logits
        other_adapter = model.decode([[as_state[None], state]], torch.tensor([prompt]), prefixes=[[]]).logits
        alone = model.decode([[state]], torch.tensor([prompt]), prefixes=[[]]).logits
    torch.testing.assert_close(read[:1], expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(read[1:], alone, atol=1e-5, rtol=1e-4)
    assert (expected - other_adapter).abs().max() > 1e-3
    texts = generate(model, [[state]], [prompt], GenerationSettings(max_new_tokens=6), prefixes=[prefix])
    assert texts == generate(model, [[as_state[DECODER], state]], [prompt], GenerationSettings(max_new_tokens=6),
                             prefixes=[[]])


def test_prompt_prefix_trains_the_decoder_adapter_only(make_model, doc_ids):
    model = make_model(ratio=3)
    model.train()
    head = model.prefix_states([doc_ids("User: ")], adapter=DECODER)[0]
    (head.keys.sum() + head.values.sum()).backward()
    assert sum(float(p.grad.abs().sum()) for p in model.adapter_parameters(DECODER) if p.grad is not None) > 0
    assert all(p.grad is None for p in model.adapter_parameters(ENCODER))
    assert model.prefix_states([[], []]) == [None, None]


def test_checkpoints_record_the_placement_and_older_ones_read_before_the_prompt(make_model, tmp_path):
    import json

    from nugget_rag.model.checkpoint_files import CONFIG_FILE, SHIPPED_CHECKPOINT, read_checkpoint_meta

    make_model().save_pretrained(tmp_path)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert meta["config"]["placement"] == "in_user_turn"
    del meta["config"]["placement"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(meta))
    assert NuggetModel.from_pretrained(tmp_path, base_model=tiny_base()).config.placement == "before_prompt"
    assert read_checkpoint_meta(SHIPPED_CHECKPOINT)["config"]["placement"] == "in_user_turn"


def test_r1_without_adapters_reads_exactly_like_fulls_prompt(make_model, doc_ids):
    """In the user turn, a document encoded after the template's opening and read at r = 1 is Full's prompt."""
    model = make_model(ratio=1)
    reference = tiny_base().model
    before, after = model.chat_prompt([{"role": "user", "content": PROMPT}])
    d1, d2 = doc_ids(DOC), doc_ids(DOC2)
    assert before == model.document_opening and len(before) > 0
    with torch.no_grad():
        state = model.compress([d1 + d2], adapter=None)[0]
        logits = model.decode([[state]], torch.tensor([after]), adapter=None, prefixes=[before]).logits
        default = model.decode([[state]], torch.tensor([after]), adapter=None).logits  # None: the opening
    expected = reference(torch.tensor([before + d1 + d2 + after])).logits[:, -len(after):]
    assert (logits - expected).abs().max() < 1e-4
    torch.testing.assert_close(default, logits)


def test_a_template_that_drops_the_users_text_names_the_other_placement():
    base = tiny_base()
    base.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match="placement='before_prompt'"):
        NuggetModel(base, NuggetConfig(scorer_layer=2, lora={"rank": 4}))
    assert NuggetModel(base, NuggetConfig(scorer_layer=2, lora={"rank": 4}, placement="before_prompt")).document_opening == []


def test_prompt_prefix_states_are_reused_until_the_decoder_changes(make_model, doc_ids, monkeypatch):
    model = make_model(ratio=3)
    opening = model.document_opening
    runs = []
    real = model.run_prefixes
    monkeypatch.setattr(model, "run_prefixes", lambda unique, adapter: runs.append(len(unique)) or real(unique, adapter))
    with torch.no_grad():
        first = model.prefix_states([opening, opening])[0]
        again = model.prefix_states([opening])[0]
        assert runs == [1] and again is first
        next(model.adapter_parameters(DECODER)).add_(0.5)  # the decoder changed: its prefix states too
        changed = model.prefix_states([opening])[0]
        assert runs == [1, 1] and not torch.equal(changed.keys, first.keys)
        model.prefix_states([opening], adapter=None)
        assert runs == [1, 1, 1]
    model.train()
    assert model.prefix_states([opening])[0].keys.requires_grad and runs == [1, 1, 1, 1]  # with gradients: always run


def test_decoder_runs_as_merged_weights_without_autograd(make_model, doc_ids):
    model = make_model(ratio=3)
    states = model.compress([doc_ids("alpha beta gamma delta epsilon")])
    ids = torch.tensor([doc_ids("which letter?")])
    weights = [layer.get_base_layer().weight for layer in model.adapters.layers]

    def logits(merged: bool) -> torch.Tensor:
        model.merged_adapters = (DECODER,) if merged else ()
        with torch.no_grad():
            return model.decode([states], ids).logits

    first = logits(merged=True)
    assert torch.allclose(first, logits(merged=False), atol=1e-5)
    assert not torch.allclose(first, model.decode([states], ids, adapter=None).logits.detach(), atol=1e-3)
    assert [layer.get_base_layer().weight for layer in model.adapters.layers] == weights  # the base weights are back
    with torch.no_grad():
        next(model.adapter_parameters(DECODER)).add_(0.5)  # an optimiser step or a load: the merged copy is rebuilt
    changed = logits(merged=True)
    assert not torch.allclose(changed, first, atol=1e-3) and torch.allclose(changed, logits(merged=False), atol=1e-5)
    model.merged_adapters = (DECODER,)
    with torch.no_grad():
        with model.use_adapter(None):
            base = model.llama(ids).logits
        with model.use_adapter(DECODER), model.use_adapter(None):  # nested in a merged pass: the original weights
            nested = model.llama(ids).logits
    assert torch.equal(nested, base) and model.adapters.original_modules is None
    assert [layer.get_base_layer().weight for layer in model.adapters.layers] == weights
    model.merged_adapters = (DECODER, ENCODER)  # the encoder merges too when asked (its last layer's q/o have none)
    doc = [doc_ids("alpha beta gamma delta epsilon")]
    with torch.no_grad():
        merged_states = model.compress(doc)[0]
        model.merged_adapters = ()
        plain_states = model.compress(doc)[0]
    assert torch.equal(merged_states.positions, plain_states.positions)
    assert torch.allclose(merged_states.keys, plain_states.keys, atol=1e-5)
    assert torch.allclose(merged_states.values, plain_states.values, atol=1e-5)
    model.merged_adapters = (DECODER,)  # with autograd the adapter runs unmerged, and trains
    model.decode([states], ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.adapter_parameters(DECODER))


def test_int8_merged_passes_swap_every_linear_layer_and_stay_close(make_model, doc_ids):
    model = make_model(ratio=3)
    states = model.compress([doc_ids("alpha beta gamma delta epsilon")])
    ids = torch.tensor([doc_ids("which letter?")])
    own = [parent._modules[name] for parent, name in model.adapters.slots]
    assert len(own) == 7 * 4  # q, k, v, o adapted; gate, up, down plain; in each of 4 layers
    seen = []
    hook = model.llama.model.layers[0].mlp.register_forward_pre_hook(lambda m, _: seen.append(type(m.up_proj)))
    with torch.no_grad():
        before = model.fingerprint(adapter=DECODER)
        stamp = model.weights_stamp(DECODER)
        plain = model.decode([states], ids).logits
        float_passes = len(seen)
        model.merged_format = "int8"
        int8 = model.decode([states], ids).logits
    hook.remove()
    assert set(seen[:float_passes]) == {torch.nn.Linear} and set(seen[float_passes:]) == {Int8Linear}
    assert [parent._modules[name] for parent, name in model.adapters.slots] == own  # the own layers are back
    assert not torch.equal(int8, plain)
    assert torch.allclose(int8, plain, atol=0.02 * float(plain.abs().max()))
    assert model.weights_stamp(DECODER) != stamp and model.fingerprint(adapter=DECODER) != before
    assert model.fingerprint(adapter=ENCODER) == model.fingerprint(adapter=ENCODER)  # the encoder is not merged
    model.decode([states], ids, labels=ids).loss.backward()  # with autograd: float LoRA, trains
    assert all(p.grad is not None for p in model.adapter_parameters(DECODER))


def test_int8_linear_takes_int8_rows_for_few_rows_and_the_float_weight_for_many():
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    layer = Int8Linear(weight, bias)
    few, many = torch.randn(2, 3, 32), torch.randn(1, MAX_INT8_ROWS + 1, 32)
    exact = torch.nn.functional.linear(few, weight, bias)
    assert layer(few).shape == exact.shape and not torch.equal(layer(few), exact)
    assert torch.allclose(layer(few), exact, atol=0.02 * float(exact.abs().max()))
    assert torch.equal(layer(many), torch.nn.functional.linear(many, weight, bias))


def test_int8_is_refused_where_its_kernels_cannot_run(make_model):
    model = make_model()
    with pytest.raises(ValueError, match="merged_format='int4'"):
        model.merged_format = "int4"
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="int8 weights are for float32 models on a CPU; this one is bfloat16 on cpu"):
        model.merged_format = "int8"
    assert model.merged_format == "float"


@pytest.mark.parametrize("variant", [
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, "rope_theta": 500000.0},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
    {"head_dim": 16},
    {"attention_bias": True, "tie_word_embeddings": False},
], ids=["llama3-rope", "linear-rope", "yarn-rope", "head-dim", "bias-untied"])
def test_other_llama_variants_read_r1_nuggets_exactly_like_fulls_prompt(variant, doc_ids):
    """The renumbering rotation holds under every rotary scaling and head layout a LLaMA checkpoint may have."""
    base = tiny_base(layers=3, **variant)
    with torch.no_grad():
        for name, p in base.model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    reference = copy.deepcopy(base.model)
    model = NuggetModel(base, NuggetConfig(ratio=1, scorer_layer=2, lora={"rank": 4}))
    before, after = model.chat_prompt([{"role": "user", "content": PROMPT}])
    doc = doc_ids(DOC)
    with torch.no_grad():
        state = model.compress([doc], adapter=None)[0]
        logits = model.decode([[state]], torch.tensor([after]), adapter=None, prefixes=[before]).logits
        expected = reference(torch.tensor([before + doc + after])).logits[:, -len(after):]
    assert state.keys.shape[-1] == reference.config.head_dim
    assert (logits - expected).abs().max() < 1e-4


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 32},
], ids=["dynamic", "longrope"])
def test_length_dependent_rotary_frequencies_are_refused(rope):
    with pytest.raises(ValueError, match=f"rope_type='{rope['rope_type']}'"):
        NuggetModel(tiny_base(layers=3, rope_scaling=rope), NuggetConfig(scorer_layer=2, lora={"rank": 4}))


def test_a_paused_stream_blocks_no_other_call(make_model, doc_ids):
    """A stream holds the shared model only while it computes a step, not while its reader is away."""
    model = make_model()
    states = model.compress([doc_ids(DOC)])
    prompts, settings = [doc_ids(PROMPT)], GenerationSettings(max_new_tokens=6)
    straight = generate(model, [states], prompts, settings)
    paused = stream_generate(model, [states], prompts, settings)
    first = next(paused)
    other: list = []
    thread = threading.Thread(target=lambda: other.append(generate(model, [states], prompts, settings, adapter=None)),
                              daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert other, "a call waited for a paused stream"
    assert [a + "".join(p[0] for p in paused) for a in first] == straight  # and the stream resumes unchanged


def test_a_capped_answer_is_announced(make_model, doc_ids, caplog):
    model = make_model()
    states = model.compress([doc_ids(DOC)])
    room = model.max_positions - len(model.document_opening) - states[0].k - len(doc_ids(PROMPT))
    with caplog.at_level(logging.WARNING, logger="nugget_rag.generation"):
        generate(model, [states], [doc_ids(PROMPT)], GenerationSettings(max_new_tokens=room + 50))
    assert f"max_new_tokens={room + 50} cut to {room}" in caplog.text


def test_states_of_another_base_model_are_refused(make_model, doc_ids):
    states = make_model().compress([doc_ids(DOC)])
    other = NuggetModel(tiny_base(seed=1), NuggetConfig(ratio=4, scorer_layer=2, lora={"rank": 4}))
    with pytest.raises(ValueError, match="made by another base model"):
        other.decode([states], torch.tensor([doc_ids(PROMPT)]))


def test_masked_grouped_heads_repeated_as_on_cuda_give_the_same_pass(make_model, doc_ids, monkeypatch):
    """On CUDA the decoder repeats grouped key/value heads (SDPA's fused kernels take a mask or groups, not both):
    the same loss and gradients as SDPA's own grouping."""
    from nugget_rag.model import attention

    model = make_model(ratio=3)
    assert model.llama.config.num_key_value_heads < model.llama.config.num_attention_heads
    runs = []
    for repeat in (False, True):
        monkeypatch.setattr(attention, "repeat_masked_gqa", lambda device, repeat=repeat: repeat)
        runs.append(_loss_and_gradients(model, doc_ids))
    _assert_same_step(*runs, 1e-6, 1e-4)


def test_nugget_passes_spare_transformers_building_a_mask(make_model, doc_ids, monkeypatch):
    """Nugget forwards bring their own mask; a padded decode must not also build (and drop) transformers' one."""
    from nugget_rag.model import attention

    built = []
    real = attention.sdpa_mask
    monkeypatch.setattr(attention, "sdpa_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    model = make_model()
    states = model.compress([doc_ids(DOC), doc_ids(DOC2)])
    ids = torch.tensor([doc_ids(PROMPT)] * 2)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, -2:] = False
    model.decode([[states[0]], [states[1]]], ids, token_mask=mask)
    assert not built
    model.llama(input_ids=ids, attention_mask=mask.long())
    assert built  # a plain forward still gets its padding mask


def test_nugget_count_is_exact_for_decimal_ratios():
    from nugget_rag.config import nugget_count

    assert [nugget_count(115, 1.15), nugget_count(100, 10), nugget_count(101, 10), nugget_count(3, 1000)] == [100, 10, 11, 1]


def test_original_positions_keep_each_nugget_at_its_place_in_its_document(make_model, doc_ids):
    renumbered, original = make_model(ratio=4), make_model(ratio=4, nugget_positions="original")
    docs = [doc_ids(DOC), doc_ids(DOC[::-1])]
    prompt = torch.tensor([doc_ids(PROMPT)])
    h = len(renumbered.document_opening)
    with torch.no_grad():
        states = renumbered.compress(docs)
        for model in (renumbered, original):
            assert model.fingerprint() == renumbered.fingerprint()  # the states are the same; only reading differs
        first, second = renumbered.layout([states]), original.layout([states])
        assert int(first.next_positions[0]) == h + sum(s.k for s in states) == int(first.counts[0])
        assert int(second.next_positions[0]) == h + sum(len(d) for d in docs) and second.counts.equal(first.counts)
        # the second document's nuggets sit after the whole first document, each at its own place (stored keys are
        # at document positions p; read, at h + n_1 + p)
        k0 = h + states[0].k
        moved = rotate_keys(states[1].keys, torch.tensor([h + len(docs[0])]), original.inv_freq)
        assert torch.allclose(second.keys[:, 0, :, k0 : k0 + states[1].k], moved, atol=1e-5)
        a = renumbered.decode([states], prompt).logits
        b = original.decode([states], prompt).logits
    assert not torch.allclose(a, b)  # the geometry changes what the decoder reads


def test_original_positions_budget_the_documents_length(make_model, doc_ids):
    model = make_model(ratio=8, nugget_positions="original")
    doc = doc_ids(DOC) * 40  # fits the positions as nuggets, not as text
    with torch.no_grad():
        states = model.compress([doc[:400], doc[:400]])
        with pytest.raises(ValueError, match="take 8\\d\\d positions"):
            model.decode([states], torch.tensor([doc_ids(PROMPT)]))

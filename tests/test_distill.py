"""Issue 24's recipe on the tiny model: KL to the uncompressed teacher, the ratio curriculum, the Scorer warm start."""

import json
import math

import pytest
import torch
from test_train import LENGTHS, config, source, tiny_model
from tiny import tiny_base, tiny_tokenizer

from nugget_rag.config import DECODER, ENCODER
from nugget_rag.model import NuggetModel
from nugget_rag.model.base_model import prepare_base_model
from nugget_rag.model.checkpoint_files import read_checkpoint_meta
from nugget_rag.train.config import Distillation
from nugget_rag.train.data import ExampleBuilder, build_examples, teacher_length
from nugget_rag.train.distill import Teacher, kl_loss
from nugget_rag.train.metrics import METRICS_FILE
from nugget_rag.train.sources import Lengths, Source
from nugget_rag.train.trainer import Trainer, train
from nugget_rag.train.warm_start import (
    answer_targets,
    batch_targets,
    importance_targets,
    order_targets,
    scorer_loss,
)

QA_ONE = {"objective": "qa", "path": "squad.json", "dev_split": None}


def qa_source(data, **options) -> dict:
    return {**QA_ONE, "path": str(data / "squad.json"), **options}


def first_batch(trainer: Trainer, ratio: float | None = None):
    batch = trainer.mixture.next_batch()
    batch.ratio = ratio
    return batch


@pytest.mark.parametrize("positions", ["targets", "all"])
def test_kl_is_zero_where_the_student_reads_everything_the_teacher_reads(positions, data, tmp_path):
    """r = 1, one document, untrained (identity) adapters: the decoder reads exactly the teacher's states."""
    cfg = config(tmp_path, [qa_source(data)], distill={"weight": 0.5, "direction": "both", "positions": positions})
    trainer = Trainer(cfg, tiny_model())
    trainer.objective(first_batch(trainer, ratio=1))
    assert trainer.objective.terms["kl"] < 1e-5
    trainer.objective(first_batch(trainer, ratio=4))  # compression makes them differ
    assert trainer.objective.terms["kl"] > 1e-4


def test_kl_is_zero_in_autoregressive_mode_where_the_stream_keeps_everything(data, tmp_path):
    """language_modeling at r = 1 with adapters off: the stream is the base model reading the text."""
    plain = {"window": 8, "segment": 8, "encoder": None, "decoder": None}
    cfg = config(tmp_path, [source("language_modeling", data)], distill={"weight": 0.5}, stream=plain)
    trainer = Trainer(cfg, tiny_model())
    trainer.objective(first_batch(trainer, ratio=1))
    assert trainer.objective.terms["kl"] < 1e-6
    trainer.objective(first_batch(trainer, ratio=4))
    assert trainer.objective.terms["kl"] > 1e-4


def test_teacher_logits_align_with_the_students_targets(data, tmp_path):
    trainer = Trainer(config(tmp_path, [source("autoencoding", data)], distill={"weight": 1.0}), tiny_model())
    batch = first_batch(trainer, ratio=1)
    teacher = trainer.teacher.target_logits(batch, soft_prompt=True)
    student = trainer.model.decode(
        [[s] for s in trainer.model.compress([d[0] for d in batch.documents], ratio=1)], batch.input_ids,
        batch.token_mask, labels=batch.labels, soft_prompt=True, prefixes=batch.prefixes,
    ).target_logits
    assert teacher.shape == student.shape == (int((batch.labels != -100).sum()), len(trainer.model.tokenizer))


@pytest.mark.parametrize("name", ["qa", "autoencoding"])
def test_kl_at_all_positions_keeps_the_cross_entropy_on_the_targets(name, data, tmp_path):
    spec = qa_source(data) if name == "qa" else source(name, data)
    trainer = Trainer(config(tmp_path, [spec], distill={"weight": 0.5}), tiny_model())
    batch = first_batch(trainer)
    trainer.objective(batch)
    on_targets = dict(trainer.objective.terms)
    trainer.objective.distill = trainer.objective.distill.model_copy(update={"positions": "all"})
    trainer.objective(batch)
    assert trainer.objective.terms["ce"] == pytest.approx(on_targets["ce"], rel=1e-5)
    # QA adds the question's tokens; autoencoding's every token is a target already
    assert (trainer.objective.terms["kl"] == pytest.approx(on_targets["kl"], rel=1e-5)) == (name == "autoencoding")


def test_kl_gradient_reaches_both_adapters_and_the_scorer(data, tmp_path):
    trainer = Trainer(config(tmp_path, [qa_source(data)], distill={"weight": 1.0}), tiny_model())
    loss = trainer.objective(first_batch(trainer))
    loss.backward()
    model = trainer.model
    for name, params in [("encoder", model.adapter_parameters(ENCODER)), ("decoder", model.adapter_parameters(DECODER)),
                         ("scorer", model.scorer.parameters())]:
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params), name


@pytest.mark.parametrize("direction,top_k", [("forward", None), ("reverse", None), ("both", None), ("forward", 3)])
def test_kl_loss_is_zero_only_for_equal_distributions(direction, top_k):
    settings = Distillation(weight=1, direction=direction, top_k=top_k)
    logits = torch.randn(5, 11)
    assert float(kl_loss(logits, logits, settings)) == pytest.approx(0, abs=1e-6)
    assert float(kl_loss(torch.randn(5, 11), logits, settings)) > 1e-3


def test_top_k_needs_the_forward_kl():
    with pytest.raises(ValueError, match="direction='forward'"):
        Distillation(weight=1, direction="reverse", top_k=5)


def test_a_teacher_with_another_tokenizer_is_refused():
    tok = tiny_tokenizer()
    tok.add_tokens(["<extra>"])
    other = prepare_base_model(tiny_base().model, tok, "other")
    with pytest.raises(ValueError, match="another tokenizer"):
        Teacher(tiny_model(), other)


def test_a_teacher_input_longer_than_its_positions_is_skipped_and_counted(data):
    qa = Source.model_validate(qa_source(data, documents_per_example=3))
    tok = tiny_tokenizer()

    def build(teacher_positions):
        builder = ExampleBuilder(qa, tok, Lengths(**LENGTHS), 512, 4, 0, True, teacher_positions=teacher_positions)
        return build_examples(qa, "train", builder, None)

    examples, _ = build(None)
    lengths = sorted(teacher_length(e) for e in examples)
    limit = lengths[len(lengths) // 2]
    kept, skipped = build(limit)
    assert skipped == {"teacher input longer than its positions": sum(n > limit for n in lengths)}
    assert len(kept) == sum(n <= limit for n in lengths) > 0


def test_curriculum_samples_ratios_in_its_range_and_records_them(data, tmp_path):
    cfg = config(tmp_path, [qa_source(data)], max_steps=3, ratios={"low": 2, "high": 8, "ramp_steps": 2})
    trainer = Trainer(cfg, tiny_model())
    seen = []
    for step in range(3):
        trainer.step = step
        seen.append(trainer._ratio())
        trainer.mixture.next_batch()
    assert seen[0] == 2 and all(2 <= r <= 8 for r in seen) and len(set(seen)) == 3
    trainer.step = 0
    result = trainer.train()
    assert read_checkpoint_meta(result.final_dir)["training"]["ratios"] == [2.0, 8.0]


def test_curriculum_draws_from_its_discrete_set_as_the_ramp_reaches_each(data, tmp_path):
    cfg = config(tmp_path, [qa_source(data)], max_steps=3, ratios={"choices": [10, 2, 5], "ramp_steps": 4})
    assert cfg.ratios.choices == [2, 5, 10] and cfg.ratio_range() == (2, 10)
    trainer = Trainer(cfg, tiny_model())
    seen: dict[int, set] = {}
    for step in (0, 4):
        trainer.step = step
        for _ in range(40):
            seen.setdefault(step, set()).add(trainer._ratio())
            trainer.mixture.draws += 1
    assert seen[0] == {2.0} and seen[4] == {2.0, 5.0, 10.0}


def test_curriculum_range_is_checked(tmp_path):
    with pytest.raises(ValueError, match="below ratios.low"):
        config(tmp_path, [QA_ONE], ratios={"low": 8, "high": 2})
    with pytest.raises(ValueError, match="not both"):
        config(tmp_path, [QA_ONE], ratios={"low": 2, "high": 8, "choices": [2, 8]})
    with pytest.raises(ValueError, match="needs low and high"):
        config(tmp_path, [QA_ONE], ratios={"low": 2})


@pytest.mark.parametrize("signal", ["observed_attention", "kvzip"])
def test_scorer_warm_start_moves_the_scorer_towards_its_signal(data, tmp_path, signal):
    model = tiny_model()
    documents = [[5 + (i * 7 + j) % 60 for j in range(30)] for i in range(3)]
    targets = importance_targets(model, documents, signal)
    assert all(abs(float(t.sum()) - 1) < 1e-5 and len(t) == 29 for t in targets)
    other = importance_targets(model, documents, "kvzip" if signal == "observed_attention" else "observed_attention")
    assert not torch.allclose(targets[0], other[0], atol=1e-3)  # the two signals differ
    before = float(scorer_loss(model, documents, targets).detach())
    cfg = config(tmp_path, [qa_source(data), source("autoencoding", data)], max_steps=1,
                 scorer_warm_start={"steps": 30, "lr": 1e-2, "signal": signal})
    encoder = [p.detach().clone() for p in model.adapter_parameters(ENCODER)]
    trainer = Trainer(cfg, model)
    trainer._warm_start()
    assert float(scorer_loss(model, documents, targets).detach()) < before
    assert all(torch.equal(a, b) for a, b in zip(encoder, model.adapter_parameters(ENCODER)))  # Scorer only
    line = json.loads((tmp_path / "run" / METRICS_FILE).read_text().splitlines()[-1])
    assert line["kind"] == "warm_start" and line["signal"] == signal and line["kl_last"] < line["kl_first"]


def test_answer_targets_fall_on_the_short_answers_tokens():
    model = tiny_model()
    text = "The river Rhine flows north. It meets the sea."  # one token a character
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    target = answer_targets(model, ids, ["Rhine", " Rhine ", "It meets the sea"], answer_tokens=8)
    start = text.index("Rhine")
    assert abs(float(target.sum()) - 1) < 1e-6 and len(target) == len(ids) - 1
    assert target.nonzero().flatten().tolist() == list(range(start, start + 5))  # the long reference is no span
    assert answer_targets(model, ids, ["Danube"], answer_tokens=8) is None


def test_answers_warm_start_fits_the_scorer_to_the_answers(data, tmp_path):
    model = tiny_model()
    cfg = config(tmp_path, [qa_source(data), source("autoencoding", data)], max_steps=1,
                 scorer_warm_start={"steps": 30, "lr": 1e-2, "signal": "answers"})
    trainer = Trainer(cfg, model)
    documents, targets = batch_targets(model, first_batch(trainer), cfg.scorer_warm_start)
    assert documents and len(documents) == len(targets)
    before = float(scorer_loss(model, documents, targets).detach())
    trainer._warm_start()
    assert float(scorer_loss(model, documents, targets).detach()) < before
    line = json.loads((tmp_path / "run" / METRICS_FILE).read_text().splitlines()[-1])
    assert line["kind"] == "warm_start" and line["signal"] == "answers"


def test_a_blended_target_keeps_the_answers_first_then_the_other_scorers_order(data, tmp_path):
    """blend_scorer: a QA document's target is (1 - share) x its answers + share x the other Scorer's order (the
    answers' tokens on top, the rest in that Scorer's order); a document without answers fits that order alone."""
    other = tiny_model()
    with torch.no_grad():
        for p in other.scorer.parameters():
            p.normal_(0, 0.5)
    other.save_pretrained(tmp_path / "other")
    model = tiny_model()
    warm = {"steps": 30, "lr": 1e-2, "signal": "answers", "blend_scorer": str(tmp_path / "other"), "blend_share": 0.25}
    cfg = config(tmp_path, [qa_source(data), source("autoencoding", data)], max_steps=1, scorer_warm_start=warm)
    trainer = Trainer(cfg, model)
    blend = model.scorer_from(tmp_path / "other")
    assert not any(p.requires_grad for p in blend.parameters())
    batch = first_batch(trainer)
    documents, targets = batch_targets(model, batch, cfg.scorer_warm_start, blend, answers=True)
    plain = dict(zip(map(tuple, documents), order_targets(model, documents, blend)))
    answered = 0
    for document, target, refs in zip(documents, targets, (r for docs, r in zip(batch.documents, batch.references)
                                                           for d in docs if len(d) > 1)):
        assert abs(float(target.sum()) - 1) < 1e-5
        answers = answer_targets(model, document, refs, 16)
        expected = plain[tuple(document)] if answers is None else 0.75 * answers + 0.25 * plain[tuple(document)]
        assert torch.allclose(target, expected)
        answered += answers is not None
    assert answered  # the draw has documents with answers in them
    for document, target in plain.items():  # the order, falling by e every n / r ranks, whatever the scores' spread
        ids, opening = model.encoder_input([list(document)])
        scores = model.score(ids, scorer=blend)[0, opening : opening + len(document) - 1]
        assert torch.equal(target.argsort(descending=True, stable=True),
                           scores.float().cpu().argsort(descending=True, stable=True))
        top = target.sort(descending=True).values
        assert abs(float(top[0] / top[1]) - math.exp(model.config.ratio / len(document))) < 1e-4
    unanswered = batch_targets(model, batch, cfg.scorer_warm_start, blend, answers=False)[1]
    assert all(torch.allclose(t, plain[tuple(d)]) for d, t in zip(documents, unanswered))
    trainer._warm_start()  # every source takes part, and the fit moves towards the blended targets
    line = json.loads((tmp_path / "run" / METRICS_FILE).read_text().splitlines()[-1])
    assert line["blend_share"] == 0.25 and line["kl_last"] < line["kl_first"]
    with pytest.raises(ValueError, match="set signal: answers"):
        config(tmp_path, [qa_source(data)], scorer_warm_start={"steps": 1, "signal": "kvzip",
                                                                "blend_scorer": str(tmp_path / "other")})


@pytest.mark.parametrize("at_branch", [False, True])
def test_a_branch_refits_the_scorer_only_when_asked(data, tmp_path, at_branch):
    """at_branch: the warm start also runs where a branch begins (an A/B arm of the Scorer); a branch otherwise, and
    a resumed branch always, keeps the Scorer of the checkpoint it starts from."""
    trunk = train(config(tmp_path / "trunk", [qa_source(data)], max_steps=2), tiny_model())
    point = trunk.output_dir / "checkpoint-2"
    optim = {"warmup_steps": 0, "lr": 1e-3, "scorer_lr": 0}
    warm = {"steps": 5, "lr": 1e-2, "signal": "answers", "at_branch": at_branch}
    arm = config(tmp_path / "arm", [qa_source(data)], max_steps=3, branch_from=str(point), scorer_warm_start=warm,
                 optim=optim)
    model = tiny_model()
    train(arm, model)
    saved = NuggetModel.from_pretrained(point, base_model=tiny_base())
    same = all(torch.equal(a, b) for a, b in zip(saved.scorer.parameters(), model.scorer.parameters()))
    assert same is not at_branch
    fits = [json.loads(x) for x in (arm.output_dir / METRICS_FILE).read_text().splitlines()
            if json.loads(x)["kind"] == "warm_start"]
    assert [x["step"] for x in fits] == ([2] if at_branch else [])
    resumed = tiny_model()
    train(arm.model_copy(update={"max_steps": 4}), resumed)  # the branch's own checkpoint: no second fit
    assert len([x for x in (arm.output_dir / METRICS_FILE).read_text().splitlines() if '"warm_start"' in x]) \
        == len(fits)


def test_answers_warm_start_without_a_qa_source_is_refused(data, tmp_path):
    with pytest.raises(ValueError, match="the run has none: add a qa source"):
        config(tmp_path, [source("autoencoding", data)], max_steps=1,
               scorer_warm_start={"steps": 3, "signal": "answers"})


def test_a_chains_later_call_keeps_its_scorer(data, tmp_path):
    """The warm start runs where a chain begins; a call that continues it (chain: true) reads the Scorer it was
    handed, not a second fit."""
    warm, optim = {"steps": 5, "lr": 1e-2, "signal": "answers"}, {"warmup_steps": 0, "lr": 1e-3, "scorer_lr": 0}
    first = train(config(tmp_path / "a", [qa_source(data)], max_steps=1, scorer_warm_start=warm, optim=optim),
                  tiny_model())
    model = tiny_model()
    train(config(tmp_path / "b", [qa_source(data)], max_steps=2, scorer_warm_start=warm, optim=optim,
                 init_from=str(first.final_dir), chain=True), model)
    exported = NuggetModel.from_pretrained(first.final_dir, base_model=tiny_base())
    assert all(torch.equal(a, b) for a, b in zip(exported.scorer.parameters(), model.scorer.parameters()))


def test_zero_steps_exports_the_warm_started_scorer(data, tmp_path):
    model = tiny_model()
    scorer = [p.detach().clone() for p in model.scorer.parameters()]
    cfg = config(tmp_path, [qa_source(data)], max_steps=0, scorer_warm_start={"steps": 3, "signal": "kvzip"})
    result = train(cfg, model)
    assert result.step == 0 and not any(torch.equal(a, b) for a, b in zip(scorer, model.scorer.parameters()))
    record = read_checkpoint_meta(result.final_dir)["training"]
    assert record["steps"] == 0 and record["scorer_warm_start"]["signal"] == "kvzip"


def test_a_resumed_run_with_another_recipe_is_warned_about(data, tmp_path, caplog):
    sources = [qa_source(data)]
    train(config(tmp_path, sources, max_steps=2), tiny_model())
    Trainer(config(tmp_path, sources, max_steps=4, distill={"weight": 0.5}), tiny_model())
    assert "another recipe: distill=" in caplog.text and '"weight": 0.5' in caplog.text


def test_distillation_trains_and_logs_both_terms(data, tmp_path):
    cfg = config(tmp_path, [qa_source(data, dev_split="dev"), source("autoencoding", data)], max_steps=2,
                 eval_every=2, distill={"weight": 0.5})
    result = train(cfg, tiny_model())
    assert any(k.startswith("kl/") for line in result.losses for k in line)
    lines = [json.loads(x) for x in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    evals = [x for x in lines if x["kind"] == "eval"]
    assert "qa:squad/kl" in evals[-1] and "qa:squad/loss" in evals[-1]
    assert read_checkpoint_meta(result.final_dir)["training"]["distill"]["weight"] == 0.5


@pytest.mark.parametrize("name", ["qa", "autoencoding"])
def test_the_teacher_reads_the_kept_prefix_states_with_the_full_texts_logits(name, data, tmp_path, monkeypatch):
    """The default teacher (the student's base, adapters off) reads each example's prompt prefix as the frozen
    model's states, computed once and kept from batch to batch, and runs only the documents' and the decoder's
    tokens: the logits of its pass over the whole text (with a soft prompt too: autoencoding)."""
    spec = qa_source(data, documents_per_example=2) if name == "qa" else source(name, data)
    trainer = Trainer(config(tmp_path, [spec], batch_size=3, distill={"weight": 0.5}), tiny_model())
    teacher, model = trainer.teacher, trainer.model
    runs = []
    real = model.run_prefixes
    monkeypatch.setattr(model, "run_prefixes", lambda unique, adapter: runs.append((len(unique), adapter))
                        or real(unique, adapter))
    batches = [first_batch(trainer) for _ in range(2)]
    soft = name == "autoencoding"
    kept = [teacher.target_logits(batch, soft) for batch in batches]
    assert runs == [(1, None)]  # one prefix, by the frozen model, once for both batches
    prefix = len(batches[-1].prefixes[0])
    assert prefix > 0 and [read for _, read in teacher.rows] == [prefix] * 3
    monkeypatch.setattr(Teacher, "keeps_prefixes", lambda self, *args: False)
    whole = [teacher.target_logits(batch, soft) for batch in batches]
    assert [read for _, read in teacher.rows] == [0] * 3
    for got, expected in zip(kept, whole):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)

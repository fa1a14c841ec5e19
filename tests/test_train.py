"""Training on the tiny model: every objective runs, overfitting works, resume is exact, frozen parts stay frozen."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.state import AcceleratorState
from pydantic import ValidationError
from safetensors.torch import load_file
from tiny import perturb_adapters, tiny_base
from torch.utils.flop_counter import FlopCounterMode

from nugget_rag.cli import build_parser, main
from nugget_rag.config import DECODER, ENCODER, NuggetConfig
from nugget_rag.corpora import DataError
from nugget_rag.model import NuggetModel, attention
from nugget_rag.train import loss, objectives
from nugget_rag.train.batches import Mixture
from nugget_rag.train.checkpoint import checkpoints
from nugget_rag.train.cli import load_config
from nugget_rag.train.config import TrainConfig
from nugget_rag.train.data import ExampleStream
from nugget_rag.train.flops import FlopCounter
from nugget_rag.train.metrics import METRICS_FILE
from nugget_rag.train.resume import CONFIG_FILE
from nugget_rag.train.sources import Source
from nugget_rag.train.trainer import Trainer, train

LENGTHS = {"document": 48, "query": 6, "answer": 12, "autoencoding": 24}
NUGGET = {"ratio": 4, "scorer_layer": 2, "lora": {"rank": 4}}


def tiny_model(seed: int = 0) -> NuggetModel:
    return NuggetModel(tiny_base(), NuggetConfig(**NUGGET, seed=seed))


def config(tmp_path, sources, **settings) -> TrainConfig:
    values = dict(output_dir=tmp_path / "run", data=sources, lengths=LENGTHS, nugget=NUGGET, batch_size=2,
                  stream={"window": 8, "segment": 8},
                  max_steps=4, eval_every=0, save_every=2, log_every=1, eval_examples=2,
                  optim={"warmup_steps": 1, "lr": 1e-3})
    values.update(settings)
    return TrainConfig.model_validate(values)


def snapshot(model: NuggetModel) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


SOURCES = {
    "autoencoding": {"objective": "autoencoding", "path": "docs.jsonl"},
    "continuation": {"objective": "continuation", "path": "docs.jsonl", "documents_per_example": 2},
    "qa": {"objective": "qa", "path": "squad.json", "documents_per_example": 3},
    "summarization": {"objective": "summarization", "path": "summ.jsonl"},
    "summary_digest": {"objective": "summarization", "path": "summ.jsonl", "documents_per_example": 3},
    "language_modeling": {"objective": "language_modeling", "path": "docs.jsonl"},
    "full_context": {"objective": "qa", "path": "squad.json", "full_context": True},
    "rag_qa": {"objective": "rag_qa", "path": "rag.json", "split": None, "dev_split": None,
               "readings": {"passages": 3, "whole_ratios": [2]}},
}


def source(name: str, data) -> dict:
    spec = dict(SOURCES[name])
    spec["path"] = str(data / spec["path"])
    return spec


@pytest.mark.parametrize("name", SOURCES)
def test_each_objective_trains_exactly_its_parts(name, data, tmp_path):
    model = tiny_model()
    before = snapshot(model)
    result = train(config(tmp_path, [source(name, data)], eval_every=2, eval_generate=2), model)
    assert result.step == 4
    losses = [v for line in result.losses for k, v in line.items() if k.startswith("loss/")]
    assert len(losses) == 4 and all(0 < v < 20 for v in losses)
    parts = objectives.parts_of(Source.model_validate(source(name, data)))
    groups = {
        "encoder": [n for n in before if f".{ENCODER}." in n and "lora_" in n],
        "decoder": [n for n in before if f".{DECODER}." in n and "lora_" in n],
        "scorer": [n for n in before if n.startswith("scorer.")],
        "soft_prompt": ["soft_prompt"],
    }
    after = snapshot(model)
    for part, names in groups.items():
        changed = [n for n in names if not torch.equal(before[n], after[n])]
        if getattr(parts, part):
            assert changed, f"{name}: {part} should train"
        else:
            assert not changed, f"{name}: {part} should stay frozen, changed {changed[:2]}"
    frozen = [n for n in before if "lora_" not in n and not n.startswith("scorer.") and n != "soft_prompt"]
    assert frozen and all(torch.equal(before[n], after[n]) for n in frozen)
    # the export loads into a fresh model with the same weights
    loaded = NuggetModel.from_pretrained(result.final_dir, base_model=tiny_base())
    assert all(torch.equal(after[n], p) for n, p in loaded.named_parameters())
    lines = [json.loads(x) for x in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "eval"] == [0, 2, 4]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000


def test_overfits_one_repeated_example(tmp_path):
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "one.jsonl").write_text(json.dumps({"text": "a quick brown fox jumps over the lazy dog"}) + "\n")
    nugget = {**NUGGET, "lora": {"rank": 16}}
    cfg = config(tmp_path, [{"objective": "autoencoding", "path": str(folder / "one.jsonl"), "split": None,
                             "dev_split": None}], nugget=nugget, max_steps=30, batch_size=1, save_every=30,
                 optim={"warmup_steps": 0, "lr": 1e-2, "schedule": "constant"})
    # a larger embedding scale than the default 0.02, so that confident predictions are within the model's reach
    model = NuggetModel(tiny_base(init_std=0.2), NuggetConfig(**nugget))
    losses = [line["loss/autoencoding:one"] for line in train(cfg, model).losses]
    assert losses[-1] < 0.5 * losses[0], losses


def test_resume_after_a_kill_reproduces_the_uninterrupted_run(data, tmp_path, monkeypatch):
    sources = [source("autoencoding", data), source("qa", data)]
    straight = train(config(tmp_path / "a", sources, max_steps=6), tiny_model())
    calls = {"n": 0}
    real_forward = loss.ObjectiveLoss.forward

    def dies_at_step_4(self, batch):
        calls["n"] += 1
        if calls["n"] == 4:  # during step 4, after checkpoint-2
            raise KeyboardInterrupt
        return real_forward(self, batch)

    monkeypatch.setattr(loss.ObjectiveLoss, "forward", dies_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path / "b", sources, max_steps=6), tiny_model())
    monkeypatch.setattr(loss.ObjectiveLoss, "forward", real_forward)
    assert [c.name for c in checkpoints(tmp_path / "b" / "run")] == ["checkpoint-2"]
    fresh = tiny_model()
    with torch.no_grad():  # weights must come from the checkpoint
        for p in fresh.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    resumed = train(config(tmp_path / "b", sources, max_steps=6), fresh)
    lines = [json.loads(x) for x in (tmp_path / "b" / "run" / METRICS_FILE).read_text().splitlines()]
    steps = [x["step"] for x in lines if x["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]  # the dead run's step-3 line was dropped on resume
    assert [x["source"] for x in lines if x["kind"] == "data"] == ["autoencoding:docs", "qa:squad"]  # once, kept
    assert [x["step"] for x in resumed.losses] == [3, 4, 5, 6]
    for a, b in zip(straight.losses[2:], resumed.losses):
        assert {k: v for k, v in a.items() if k.startswith("loss/")} == {k: v for k, v in b.items() if k.startswith("loss/")}


def test_resume_refuses_other_settings(data, tmp_path):
    train(config(tmp_path, [source("autoencoding", data)], max_steps=2), tiny_model())
    with pytest.raises(ValueError, match="lengths"):
        Trainer(config(tmp_path, [source("autoencoding", data)], max_steps=4, lengths={**LENGTHS, "autoencoding": 20}),
                tiny_model())


def test_resume_takes_a_setting_added_since_as_its_default(data, tmp_path):
    train(config(tmp_path, [source("autoencoding", data)], max_steps=2, stream={}), tiny_model())
    saved = tmp_path / "run" / CONFIG_FILE
    written = json.loads(saved.read_text())
    del written["stream"]  # as written before the setting existed
    saved.write_text(json.dumps(written))
    Trainer(config(tmp_path, [source("autoencoding", data)], max_steps=4, stream={}), tiny_model())
    with pytest.raises(ValueError, match="stream"):
        Trainer(config(tmp_path, [source("autoencoding", data)], max_steps=4), tiny_model())


def test_resume_ignores_init_from_which_only_shapes_a_start(data, tmp_path):
    first = train(config(tmp_path, [source("autoencoding", data)], max_steps=2), tiny_model())
    resumed = train(config(tmp_path, [source("autoencoding", data)], max_steps=3, init_from=str(first.final_dir)),
                    tiny_model())
    assert resumed.step == 3 and [x["step"] for x in resumed.losses] == [3]


def test_a_branch_begins_at_another_runs_checkpoint_with_its_own_data(data, tmp_path):
    """branch_from: the checkpoint's parts, optimiser, schedule and step; this run's sources, streams afresh."""
    trunk = train(config(tmp_path / "trunk", [source("autoencoding", data)], max_steps=4), tiny_model())
    point = trunk.output_dir / "checkpoint-2"

    def perturbed() -> NuggetModel:  # weights that must come from the checkpoint
        return perturb_adapters(tiny_model())

    sources = [source("qa", data)]
    at_point = train(config(tmp_path / "zero", sources, max_steps=2, branch_from=str(point)), perturbed())
    assert at_point.step == 2  # nothing left to train: the export is the checkpoint's parts
    saved, exported = load_file(point / "nugget.safetensors"), load_file(at_point.final_dir / "nugget.safetensors")
    assert saved.keys() == exported.keys()
    assert [k for k in saved if not torch.equal(saved[k].float(), exported[k].float())] == []
    branch = train(config(tmp_path / "branch", sources, max_steps=4, branch_from=str(point)), perturbed())
    assert [x["step"] for x in branch.losses] == [3, 4]
    assert [x["lr"] for x in branch.losses] == [x["lr"] for x in trunk.losses[2:]]  # the schedule goes on
    assert all("loss/qa:squad" in x and "loss/autoencoding:docs" not in x for x in branch.losses)  # this run's data
    with pytest.raises(ValueError, match="not a run's checkpoint"):
        Trainer(config(tmp_path / "wrong", sources, branch_from=str(trunk.final_dir)), tiny_model())


def test_dev_losses_at_further_ratios_are_those_the_weights_give_at_that_ratio(data, tmp_path):
    """eval_ratios: each source's dev loss also at r = 2 (SOURCE@r2/loss), beside the model's r = 4: the loss the
    same weights give where r = 2 is the model's ratio."""
    sources = [source("autoencoding", data), source("qa", data)]

    def first_eval(ratio: float, **settings) -> dict:
        cfg = config(tmp_path / f"r{ratio}", sources, nugget={**NUGGET, "ratio": ratio}, max_steps=1, eval_every=1,
                     **settings)
        result = train(cfg, NuggetModel(tiny_base(), NuggetConfig(**{**NUGGET, "ratio": ratio})))
        lines = [json.loads(x) for x in (result.output_dir / METRICS_FILE).read_text().splitlines()]
        return next(x for x in lines if x["kind"] == "eval" and x["step"] == 0)

    both, at_two = first_eval(4, eval_ratios=[2]), first_eval(2)
    for name in ("autoencoding:docs", "qa:squad"):
        assert both[f"{name}@r2/loss"] == at_two[f"{name}/loss"]
        assert both[f"{name}@r2/loss"] != both[f"{name}/loss"]
    with pytest.raises(ValidationError, match="eval_ratios"):
        config(tmp_path, sources, eval_ratios=[0.5])


def test_resume_may_turn_gradient_checkpointing_on_with_the_same_updates(data, tmp_path):
    sources = [source("autoencoding", data), source("qa", data)]
    optim = {"warmup_steps": 0, "lr": 1e-3, "schedule": "constant"}  # the same rates in runs of 2 and 4 steps
    straight = train(config(tmp_path / "a", sources, max_steps=4, optim=optim), tiny_model())
    train(config(tmp_path / "b", sources, max_steps=2, optim=optim), tiny_model())
    resumed = train(config(tmp_path / "b", sources, max_steps=4, optim=optim, gradient_checkpointing=True),
                    tiny_model())
    assert [x["step"] for x in resumed.losses] == [3, 4]
    for a, b in zip(straight.losses[2:], resumed.losses):
        assert {k: v for k, v in a.items() if k.startswith("loss/")} == {k: v for k, v in b.items() if k.startswith("loss/")}


def test_init_from_default_needs_the_default_base_model(data, tmp_path):
    with pytest.raises(ValueError, match="pass a checkpoint directory"):
        Trainer(config(tmp_path, [source("autoencoding", data)], init_from="default"), tiny_model())


def test_bad_data_is_named_before_training(data, tmp_path):
    with pytest.raises(DataError, match="not found"):
        Trainer(config(tmp_path, [{"objective": "qa", "path": str(data / "missing.json")}]), tiny_model())
    with pytest.raises(DataError, match="'question'"):
        Trainer(config(tmp_path, [{"objective": "qa", "path": str(data / "docs.jsonl"), "context_field": "text"}]),
                tiny_model())
    with pytest.raises(ValueError, match="positions"):
        Trainer(config(tmp_path, [source("continuation", data)], lengths={**LENGTHS, "query": 600}), tiny_model())
    with pytest.raises(ValueError, match="test"):
        config(tmp_path, [{**source("qa", data), "split": "test"}])
    with pytest.raises(ValueError, match="dev_split='test'"):
        config(tmp_path, [{**source("qa", data), "dev_split": "test"}])


def test_a_file_with_a_test_part_is_read_only_by_part(data, tmp_path):
    """splits.json (as in ../shared/data) fixes the parts; no setting may read the test part into training."""
    (data / "splits.json").write_text(json.dumps({"squad.json": {"train": [0, 30], "dev": [30, 35], "test": [35, 40]}}))
    assert Trainer(config(tmp_path, [source("qa", data)], max_steps=1), tiny_model()).data_lines[0]["examples"] == 30
    with pytest.raises(DataError, match="split=None would read all of squad.json"):
        Trainer(config(tmp_path, [{**source("qa", data), "split": None}]), tiny_model())
    with pytest.raises(DataError, match="format=auto, not format=text"):
        Trainer(config(tmp_path, [{"objective": "autoencoding", "path": str(data / "squad.json"), "format": "text"}]),
                tiny_model())
    with pytest.raises(DataError, match="name each file as its own source"):
        Trainer(config(tmp_path, [{"objective": "autoencoding", "path": str(data), "format": "json"}]), tiny_model())
    (data / "splits.json").write_text(json.dumps({"docs.jsonl": {"train": [0, 30], "test": [30, 40]}}))
    docs = {"objective": "autoencoding", "path": str(data / "docs.jsonl"), "dev_split": None}
    counts = [Trainer(config(tmp_path / fmt, [{**docs, "format": fmt}]), tiny_model()).data_lines[0]["examples"]
              for fmt in ("json", "auto")]
    assert counts[0] == counts[1] > 0  # a format that reads the same lines keeps the same parts


def test_processes_draw_disjoint_slices_of_one_batch():
    """Under DDP every process keeps its own slice of the same draw, so the effective batch grows with the processes."""
    examples = [{"input_ids": [i + 1], "target_start": 0, "documents": [[i + 1]], "references": [str(i)],
                 "prefix": []} for i in range(40)]

    def batches(rank: int, world: int, batch_size: int) -> list[list[int]]:
        mixture = Mixture([ExampleStream(examples, seed=3)], [1.0], 0, batch_size, 0, rank=rank, world=world)
        return [mixture.next_batch().input_ids[:, 0].tolist() for _ in range(5)]

    alone, first, second = batches(0, 1, 4), batches(0, 2, 2), batches(1, 2, 2)
    for whole, a, b in zip(alone, first, second):
        assert sorted(a + b) == sorted(whole) and not set(a) & set(b)
    with pytest.raises(ValueError, match="rank 2"):
        Mixture([ExampleStream(examples, seed=3)], [1.0], 0, 2, 0, rank=2, world=2)


def test_grouping_by_length_pads_less_with_the_same_examples_and_resumes():
    rng = random.Random(0)
    examples = [{"input_ids": [i + 1] * rng.randint(1, 60), "target_start": 0, "documents": [[i + 1] * rng.randint(1, 200)],
                 "references": [str(i)], "prefix": []} for i in range(64)]

    def mixture(group: int) -> Mixture:
        return Mixture([ExampleStream(examples, seed=3)], [1.0], 0, 4, 0, group_by_length=group)

    def padding(batch) -> int:
        return batch.padded_tokens - batch.tokens

    plain, grouped = mixture(0), mixture(8)
    plain_batches = [plain.next_batch() for _ in range(8)]
    grouped_batches = [grouped.next_batch() for _ in range(8)]
    firsts = lambda batches: sorted(int(b.input_ids[i, 0]) for b in batches for i in range(len(b.documents)))  # noqa: E731
    assert firsts(plain_batches) == firsts(grouped_batches)  # one group: the same 32 examples
    assert sum(map(padding, grouped_batches)) < 0.7 * sum(map(padding, plain_batches))

    resumed, going = mixture(8), mixture(8)
    for _ in range(11):
        going.next_batch()
    resumed.load_state_dict(json.loads(json.dumps(going.state_dict())))
    for _ in range(7):  # across the end of the second group
        assert torch.equal(resumed.next_batch().input_ids, going.next_batch().input_ids)


def test_metric_lines_report_model_flops_and_utilisation(data, tmp_path):
    cfg = config(tmp_path, [source("autoencoding", data)], max_steps=2, log_every=1, peak_tflops=1.0)
    line = train(cfg, tiny_model()).losses[-1]
    assert line["model_tflops_per_s"] > 0 and line["mfu"] == pytest.approx(line["model_tflops_per_s"], rel=0.01)
    assert 0 <= line["padding"] < 1


def test_flop_counter_matches_torchs_count_of_a_forward_pass():
    """torch's FlopCounterMode on eager attention, which computes the whole square of scores where the counter
    counts the causal half that a token needs."""
    model = tiny_base(attn_implementation="eager").model
    counter, layers, tokens = FlopCounter(model.config), model.config.num_hidden_layers, 24
    with FlopCounterMode(display=False) as measured, torch.no_grad():
        model(input_ids=torch.randint(0, model.config.vocab_size, (1, tokens)))
    masked = counter.attention * layers * (tokens * tokens - tokens * (tokens + 1) // 2)
    assert measured.get_total_flops() == counter.forward([(tokens, 0)], targets=tokens) + masked
    assert counter.trained([(tokens, 4)]) == 2 * counter.forward([(tokens, 4)])


def test_empty_documents_are_skipped_and_counted(data, tmp_path):
    lines = (data / "docs.jsonl").read_text() + json.dumps({"text": "   "}) + "\n" + json.dumps({"text": ""}) + "\n"
    (data / "docs.jsonl").write_text(lines)
    train(config(tmp_path, [{**source("autoencoding", data), "dev_split": None}], max_steps=1), tiny_model())
    first = json.loads((tmp_path / "run" / METRICS_FILE).read_text().splitlines()[0])
    assert first["kind"] == "data" and first["skipped"] == {"too short": 2}


def test_streaming_source_trains(data, tmp_path):
    cfg = config(tmp_path, [{**source("autoencoding", data), "streaming": True}], max_steps=2)
    assert train(cfg, tiny_model()).step == 2


def test_cli_trains_a_saved_llama_directory(data, tmp_path, capsys):
    base = tiny_base()
    base.model.save_pretrained(tmp_path / "llama")
    base.tokenizer.save_pretrained(tmp_path / "llama")
    argv = ["--output-dir", str(tmp_path / "run"), "--base-model", str(tmp_path / "llama"),
            "--data", f"autoencoding:{data / 'docs.jsonl'},dev_split=null", "--max-steps", "2", "--save-every", "1",
            "--nugget.scorer-layer", "2", "--nugget.lora.rank", "4", "--lengths.autoencoding", "24",
            "--batch-size", "2", "--eval-every", "0"]
    assert main(["train", *argv]) == 0
    assert "trained 2 steps" in capsys.readouterr().out
    assert (tmp_path / "run" / "final" / "nugget.safetensors").is_file()
    assert main(["train", *argv[:-2], "--eval-every", "-1"]) == 2
    assert "eval_every" in capsys.readouterr().err


def test_flag_values_keep_their_types(tmp_path):
    """YAML reads a bare `no` as False and `2026` as a number; flags and config files must still mean what they say."""
    (tmp_path / "run.yaml").write_text("mixed_precision: no\noutput_dir: run\ndata: [{objective: qa, path: x.json}]\n")
    from_file = load_config(build_parser().parse_args(["train", "--config", str(tmp_path / "run.yaml")]))
    from_flag = load_config(build_parser().parse_args(
        ["train", "--output-dir", "2026", "--data", "qa:x.json,weight=2,dev_split=null", "--mixed-precision", "no",
         "--base-model", "yes", "--optim.lr", "1e-3", "--gradient-checkpointing", "true", "--optim.betas", "[0.8, 0.9]",
         "--nugget.ratio", "2.5"]))
    assert from_file.mixed_precision == from_flag.mixed_precision == "no"
    assert (from_flag.output_dir.name, from_flag.base_model) == ("2026", "yes")
    assert (from_flag.data[0].weight, from_flag.data[0].dev_split) == (2.0, None)
    assert (from_flag.optim.lr, from_flag.gradient_checkpointing, from_flag.optim.betas) == (1e-3, True, (0.8, 0.9))
    assert from_flag.nugget.ratio == 2.5
    with pytest.raises(ValidationError, match="ratio must be a number >= 1"):
        NuggetConfig(ratio="ten")


@pytest.mark.parametrize("in_user_turn", [True, False])
def test_task_examples_carry_the_decoders_prompt_prefix(data, in_user_turn):
    from nugget_rag.train.data import ExampleBuilder
    from nugget_rag.train.records import load_records
    from nugget_rag.train.sources import Lengths, Source

    model = tiny_model()
    qa = Source.model_validate({**source("qa", data), "documents_per_example": 1, "split": None})
    builder = ExampleBuilder(qa, model.tokenizer, Lengths(**LENGTHS), model.max_positions, 4, 0, in_user_turn=in_user_turn)
    records = load_records(qa, None)
    example = builder(records[:1], [0])
    prefix, ids = example["prefix"][0], example["input_ids"][0]
    assert (model.tokenizer.decode(prefix) == "<|im_start|>user\n") is in_user_turn
    assert (prefix == []) is not in_user_turn
    assert model.tokenizer.decode(ids).startswith("\n\nBased on" if in_user_turn else "<|im_start|>user\nBased on")


def test_init_from_a_checkpoint_of_another_placement_is_named(data, tmp_path, caplog):
    NuggetModel(tiny_base(), NuggetConfig(**NUGGET, placement="before_prompt")).save_pretrained(tmp_path / "old")
    cfg = config(tmp_path, [source("qa", data)], max_steps=1, save_every=1, init_from=str(tmp_path / "old"))
    with caplog.at_level("WARNING"):
        train(cfg, tiny_model())
    assert "placement=before_prompt" in caplog.text and "placement=in_user_turn" in caplog.text


def test_examples_end_where_their_targets_end():
    """Reconstructions learn to stop (EOS); a cut answer is not taught to stop; a cut-off extractive answer skips."""
    from nugget_rag.train.data import ExampleBuilder
    from nugget_rag.train.sources import Lengths, Source

    tok = tiny_model().tokenizer
    lengths = Lengths(document=20, query=4, answer=6, autoencoding=24, min_document=4)

    def build(objective: str, row: dict) -> dict:
        builder = ExampleBuilder(Source(objective=objective, path="x"), tok, lengths, 512, 4, 0, in_user_turn=True)
        return builder({k: [v] for k, v in row.items()}, [0])

    ae = build("autoencoding", {"text": "the cat sat on a mat"})
    assert ae["input_ids"][0][-1] == tok.eos_token_id and ae["input_ids"][0][:-1] == ae["documents"][0][0]
    long_summary = build("summarization", {"article": "the cat sat on a mat " * 3, "highlights": "a long summary here"})
    short_summary = build("summarization", {"article": "the cat sat on a mat " * 3, "highlights": "cat"})
    assert long_summary["input_ids"][0][-1] != tok.eos_token_id and short_summary["input_ids"][0][-1] == tok.eos_token_id
    row = {"context": "the cat sat on a mat while the dog ran far away", "question": "Who ran?", "answers": ["dog"]}
    assert build("qa", {**row, "answers": ["cat"]})["skip"] == [""]
    assert build("qa", row)["skip"] == ["answer cut off with the document"]
    assert build("summarization", {"article": "the cat sat", "highlights": " "})["skip"] == ["no answer"]


def test_summaries_of_several_documents_make_a_digest():
    """documents_per_example d > 1: the record and d - 1 other records of its batch in random order, each document
    compressed alone, SUMMARY_OF_DOCUMENT, the target their summaries in that order; fewer records, fewer documents.
    d = 1 is the one-document example (SUMMARY_PROMPT) it always was."""
    from nugget_rag.config import nugget_count
    from nugget_rag.prompts import SUMMARY_OF_DOCUMENT, SUMMARY_PROMPT
    from nugget_rag.train.data import ExampleBuilder
    from nugget_rag.train.sources import Lengths, Source

    tok = tiny_model().tokenizer
    lengths = Lengths(document=40, answer=60, min_document=4)
    rows = [{"document": f"article {c} " * 3, "summary": f"Summary {c}."} for c in "abcde"]
    by_document = {tok.decode(tok(r["document"], add_special_tokens=False)["input_ids"]): r["summary"] for r in rows}

    def builder(d: int, **fields) -> ExampleBuilder:
        source = Source(objective="summarization", path="x", documents_per_example=d, **fields)
        return ExampleBuilder(source, tok, lengths, 512, 4, 0, in_user_turn=True)

    def build(d: int, batch: list[dict], **fields) -> list[dict]:
        out = builder(d, **fields)({k: [r[k] for r in batch] for k in batch[0]}, [0])
        return [dict(zip(out, values)) for values in zip(*out.values())]

    def read(example: dict) -> tuple[list[str], str, str]:
        """(the documents' texts, the prompt, the target without its EOS)"""
        ids, start = example["input_ids"], example["target_start"]
        target = ids[start:-1] if ids[-1] == tok.eos_token_id else ids[start:]
        return [tok.decode(d) for d in example["documents"]], tok.decode(ids[:start]), tok.decode(target)

    one = builder(1)
    for row, example in zip(rows, build(1, rows)):
        assert example == one.task([row["document"]], SUMMARY_PROMPT, row["summary"], [row["summary"]])
        documents, prompt, target = read(example)
        assert documents == [row["document"]] and SUMMARY_PROMPT in prompt and target == row["summary"]

    digests = build(3, rows)
    assert len(digests) == len(rows) and not any(e["skip"] for e in digests)
    first = []
    for row, example in zip(rows, digests):
        documents, prompt, target = read(example)
        assert len(documents) == len(set(documents)) == 3 and row["document"].strip() in [d.strip() for d in documents]
        assert SUMMARY_OF_DOCUMENT in prompt and SUMMARY_PROMPT not in prompt
        assert target == " ".join(by_document[d] for d in documents)  # the summaries in the documents' order
        assert example["references"] == [target]
        first.append(documents[0].strip() == row["document"].strip())
    assert not all(first)  # the record's own document is not always first
    # the source's own field names (article/highlights) read alike
    cnn = [{"article": r["document"], "highlights": r["summary"]} for r in rows]
    assert [e["input_ids"] for e in build(3, cnn)] == [e["input_ids"] for e in digests]
    # a batch of fewer records than d: fewer documents; one record alone is a digest of one
    assert [len(e["documents"]) for e in build(3, rows[:2])] == [2, 2]
    (alone,) = build(3, rows[:1])
    assert read(alone)[0] == [rows[0]["document"]] and SUMMARY_OF_DOCUMENT in read(alone)[1]
    assert read(alone)[2] == rows[0]["summary"]
    # a record without a summary is skipped, and never joins another's digest
    empty = [{**rows[0], "summary": " "}, *rows[1:3]]
    assert [e["skip"] for e in build(3, empty)] == ["no answer", "", ""]
    assert all(len(e["documents"]) == 2 for e in build(3, empty)[1:])
    # the decoder positions a digest may take count its d documents' nuggets
    assert (objectives.OBJECTIVES["summarization"].positions(builder(3))
            - objectives.OBJECTIVES["summarization"].positions(builder(1))) == 2 * nugget_count(40, 4)
    with pytest.raises(ValueError, match="decoder positions for summarization"):
        ExampleBuilder(Source(objective="summarization", path="x", documents_per_example=3), tok, lengths,
                       objectives.OBJECTIVES["summarization"].positions(builder(1)) + 10, 4, 0, in_user_turn=True)


def test_jsonl_lines_end_at_newlines_only_and_must_be_objects(tmp_path):
    from nugget_rag.corpora import read_documents

    good = tmp_path / "good.jsonl"
    good.write_text("\ufeff" + json.dumps({"text": "a\u2028b"}, ensure_ascii=False) + "\n" + json.dumps({"text": "c"}) + "\n")
    assert [d["text"] for d in read_documents(good)] == ["a\u2028b", "c"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "c"}) + "\n" + json.dumps("just a string") + "\n")
    with pytest.raises(DataError, match="bad.jsonl:2 is a JSON str, not an object"):
        read_documents(bad)


def test_percentage_splits_leave_no_unit_out(tmp_path):
    from nugget_rag.corpora import split_filter

    (tmp_path / "splits.json").write_text(json.dumps({"c.txt": {"train": "first 80% of articles",
                                                                "test": "last 20% of articles"}}))
    for n in range(1, 80):
        parts = [[i for i in range(n) if split_filter(tmp_path / "c.txt", s)(i, n)] for s in ("train", "dev", "test")]
        assert sorted(sum(parts, [])) == list(range(n)), n


def test_objectives_come_from_the_registry(tmp_path):
    def checked(**source) -> Source:  # a run's config checks its sources against the registry
        return TrainConfig(output_dir=tmp_path, data=[source]).data[0]

    with pytest.raises(ValueError, match="unknown objective 'nope'; registered: autoencoding, continuation, language_modeling, qa"):
        checked(objective="nope", path="x.json")

    @objectives.register("test_only")
    class TestOnly(objectives.Objective):
        parts = objectives.Parts(encoder=True, decoder=False, scorer=True, soft_prompt=False)

    try:
        assert checked(objective="test_only", path="x.json").objective == "test_only"
        with pytest.raises(ValueError, match="full_context applies to qa and summarization, not test_only"):
            checked(objective="test_only", path="x.json", full_context=True)
    finally:
        objectives.OBJECTIVES.pop("test_only")


def gradients(model: NuggetModel) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["qa", "autoencoding"])
def test_a_micro_batch_run_in_several_passes_has_the_same_gradient(name, data, tmp_path):
    trainer = Trainer(config(tmp_path, [source(name, data)], batch_size=5, distill={"weight": 0.5}), tiny_model())
    batch = trainer.mixture.next_batch()
    trainer.model.train()
    whole = trainer._backward([batch])
    expected = gradients(trainer.model)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.passes = 2  # 3 + 2 examples, each part cut to its own longest
    split = trainer._backward([batch])
    got = gradients(trainer.model)
    assert expected and got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-6)
    assert split[0][0] == pytest.approx(whole[0][0], rel=1e-5)
    assert split[0][1].keys() == {"ce", "kl"}


def test_running_out_of_gpu_memory_repeats_the_step_in_more_passes(data, tmp_path, caplog, monkeypatch):
    sources = [source("qa", data)]
    reference = tiny_model()
    train(config(tmp_path / "a", sources, batch_size=4, max_steps=2), reference)

    forward = loss.ObjectiveLoss.forward

    def small_memory(self, batch):
        if len(batch.documents) > 2:
            raise torch.OutOfMemoryError("simulated: more than 2 examples")
        return forward(self, batch)

    monkeypatch.setattr(loss.ObjectiveLoss, "forward", small_memory)
    model = tiny_model()
    trainer = Trainer(config(tmp_path / "b", sources, batch_size=4, max_steps=2), model)
    with caplog.at_level("WARNING"):
        result = trainer.train()
    assert trainer.passes == 2 and "2 passes" in caplog.text
    assert [line["passes"] for line in result.losses] == [2, 2]
    after, expected = snapshot(model), snapshot(reference)
    for key in expected:
        torch.testing.assert_close(after[key], expected[key], rtol=1e-4, atol=1e-6)


def test_running_out_of_memory_with_one_example_per_pass_is_raised(data, tmp_path, monkeypatch):
    def no_memory(self, batch):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(loss.ObjectiveLoss, "forward", no_memory)
    trainer = Trainer(config(tmp_path, [source("qa", data)], batch_size=2, max_steps=1), tiny_model())
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()
    assert trainer.passes == 2


def test_compiled_layers_give_the_eager_loss_and_gradients(data, tmp_path):
    """`compile` (torch.compile per layer, attention eager) changes speed only: the same loss and gradients for a
    distilled QA micro-batch, whose passes switch between both adapters and none; with gradient checkpointing too."""
    results = []
    for arm, settings in enumerate([{}, {"compile": True}, {"compile": True, "gradient_checkpointing": True}]):
        trainer = Trainer(config(tmp_path / str(arm), [source("qa", data)], batch_size=3, distill={"weight": 0.5},
                                 **settings), tiny_model())
        trainer.model.train()
        loss_value = trainer._backward([trainer.mixture.next_batch()])[0][0]
        results.append((loss_value, gradients(trainer.model)))
    (eager_loss, eager), *compiled = results
    for loss_value, grads in compiled:
        assert loss_value == pytest.approx(eager_loss, rel=1e-5)
        assert eager and grads.keys() == eager.keys()
        for key in eager:
            torch.testing.assert_close(grads[key], eager[key], rtol=1e-3, atol=1e-5)


def test_max_time_counts_the_setup_too(data, tmp_path):
    """A bounded GPU call must end in time: loading the model and tokenising the data count against max_time."""
    trainer = Trainer(config(tmp_path, [source("qa", data)], max_time=60), tiny_model())
    trainer.created -= 61  # as if setup had taken a minute
    trainer.train()
    assert trainer.step == 1 and (tmp_path / "run" / "final").is_dir()


def test_a_stop_signal_ends_the_run_after_its_update_with_a_checkpoint_that_resumes(data, tmp_path):
    """SIGTERM (a session's end, `kill`) mid-run: the loop finishes the update it is in, checkpoints and returns, the
    signal's handler is restored, and the same command resumes from that update."""
    import signal

    cfg = config(tmp_path, [source("qa", data)], max_steps=6, save_every=100)
    trainer = Trainer(cfg, tiny_model())
    backward = trainer._backward

    def signalled(batches):  # the signal arrives during the second update
        if trainer.step == 1:
            signal.raise_signal(signal.SIGTERM)
        return backward(batches)

    trainer._backward = signalled
    before = signal.getsignal(signal.SIGTERM)
    trainer.train()
    assert trainer.step == 2 and signal.getsignal(signal.SIGTERM) is before
    assert checkpoints(tmp_path / "run")[-1].name.endswith("2")
    assert Trainer(cfg, tiny_model()).train().step == 6
    lines = [json.loads(x) for x in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "setup"] == [1, 3]  # the second call began at update 3


def test_the_trainers_bf16_step_takes_cudas_fused_branch_with_one_dtype(data, tmp_path, monkeypatch, request):
    """The trainer's own step as it runs on a GPU: Accelerate's bf16 autocast over float32 weights, the decoder's
    causality given to SDPA as a `CausalBias` flag (CUDA's branch, forced here on the CPU). RoPE's float32 cos/sin
    leave q and k float32 while v is bf16; the fused reader must hand SDPA one dtype. Fused and reference agree
    within bf16's precision, and the Scorer gets its Eq. 18 gradient either way."""
    monkeypatch.setattr(attention, "takes_causal_flag", lambda device: True)
    AcceleratorState._reset_state(reset_partial_state=True)  # Accelerate keeps one precision a process
    request.addfinalizer(lambda: AcceleratorState._reset_state(reset_partial_state=True))
    results = {}
    for arm in ("reference", "fused"):
        trainer = Trainer(config(tmp_path / arm, [source("qa", data)], batch_size=3, cpu=True, mixed_precision="bf16",
                                 attention=arm), tiny_model())
        assert trainer.accelerator.mixed_precision == "bf16"
        assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
        trainer.model.train()
        results[arm] = trainer._backward([trainer.mixture.next_batch()])[0][0], gradients(trainer.model)
    (loss_value, grads), (fused_loss, fused_grads) = results["reference"], results["fused"]
    assert fused_loss == pytest.approx(loss_value, rel=2e-2)
    assert grads.keys() == fused_grads.keys() and any(name.startswith("scorer.") for name in grads)
    for name in grads:
        assert torch.isfinite(fused_grads[name]).all(), name
    scorer = [name for name in grads if name.startswith("scorer.")]
    assert all(float(fused_grads[name].abs().sum()) > 0 for name in scorer)


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_a_valid_training_config(path):
    config = load_config(build_parser().parse_args(["train", "--config", str(path)]))
    assert config.data and config.max_steps > 0


def test_a_scorer_learning_rate_of_zero_keeps_the_scorer(data, tmp_path):
    model = tiny_model()
    before = snapshot(model)
    train(config(tmp_path, [source("qa", data)], optim={"warmup_steps": 1, "lr": 1e-3, "scorer_lr": 0}), model)
    after = snapshot(model)
    assert all(torch.equal(before[n], after[n]) for n in before if n.startswith("scorer."))
    assert any(not torch.equal(before[n], after[n]) for n in before if f".{DECODER}." in n and "lora_" in n)


def test_an_encoder_learning_rate_of_zero_keeps_every_stored_state_valid(data, tmp_path, monkeypatch):
    model = tiny_model()
    before, fingerprint = snapshot(model), model.fingerprint(ranked=True)
    encoder_grads = []
    step = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):
        encoder_grads.extend(p.grad for p in model.adapter_parameters(ENCODER))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    train(config(tmp_path, [source("qa", data), source("autoencoding", data)],
                 optim={"warmup_steps": 1, "lr": 1e-3, "encoder_lr": 0, "scorer_lr": 0}), model)
    after = snapshot(model)
    assert all(torch.equal(before[n], after[n]) for n in before if f".{ENCODER}." in n)
    assert any(not torch.equal(before[n], after[n]) for n in before if f".{DECODER}." in n and "lora_" in n)
    assert encoder_grads and all(g is None for g in encoder_grads)  # not differentiated, not only not stepped
    assert model.fingerprint(ranked=True) == fingerprint  # with the Scorer kept too (scorer_lr 0)


def test_resume_takes_a_nested_setting_added_since_as_its_default(data, tmp_path):
    train(config(tmp_path, [source("autoencoding", data)], max_steps=2), tiny_model())
    saved = tmp_path / "run" / CONFIG_FILE
    written = json.loads(saved.read_text())
    del written["optim"]["encoder_lr"]  # as written before the setting existed
    saved.write_text(json.dumps(written))
    Trainer(config(tmp_path, [source("autoencoding", data)], max_steps=4), tiny_model())
    with pytest.raises(ValueError, match="optim"):
        Trainer(config(tmp_path, [source("autoencoding", data)], max_steps=4,
                       optim={"warmup_steps": 1, "lr": 1e-3, "encoder_lr": 0}), tiny_model())


def rag_builder(data, **readings):
    from nugget_rag.train.data import ExampleBuilder
    from nugget_rag.train.records import load_records
    from nugget_rag.train.sources import Lengths

    model = tiny_model()
    rag = Source.model_validate({**source("rag_qa", data), "readings": {"passages": 3, **readings}})
    builder = ExampleBuilder(rag, model.tokenizer, Lengths(**LENGTHS), model.max_positions, 4, 0, in_user_turn=True)
    return model, builder, load_records(rag, None)


def test_rag_examples_read_the_gold_whole_among_the_closest_distractors(data):
    model, builder, records = rag_builder(data, whole_ratios=[1], skim_ratios=[5, 20], gold_compressed=0, no_gold=0)
    out = builder(records[:10], [0])
    tok = model.tokenizer
    for i, docs in enumerate(out["documents"]):
        gold = tok(records[i]["context"])["input_ids"][: LENGTHS["document"]]
        assert len(docs) == 3 and gold in docs and out["teacher_documents"][i] == [gold]
        same = {tuple(tok(r["context"])["input_ids"][: LENGTHS["document"]]) for r in records
                if r["article"] == records[i]["article"]}
        assert all(tuple(d) in same for d in docs)  # distractors from the gold's own article
        readings = out["readings"][i]
        assert readings[docs.index(gold)] == 1.0 and all(readings[j] in (5.0, 20.0)
                                                           for j in range(3) if docs[j] != gold)


def test_rag_examples_without_gold_answer_with_the_given_wording_and_a_compressed_gold_is_skimmed(data):
    _, builder, records = rag_builder(data, no_gold=1.0, gold_compressed=0.0)
    out = builder(records[:4], [0])
    assert all(refs == ["The documents do not say."] for refs in out["references"])
    assert all(not teacher for teacher in out["teacher_documents"])
    _, builder, records = rag_builder(data, gold_compressed=1.0, no_gold=0.0, skim_ratios=[8])
    assert all(r == [8.0, 8.0, 8.0] for r in builder(records[:4], [0])["readings"])


def test_a_batch_reads_each_document_at_its_own_ratio(data):
    from nugget_rag.train.batches import collate

    model, builder, records = rag_builder(data, whole_ratios=[1], skim_ratios=[5], gold_compressed=0, no_gold=0)
    out = builder(records[:2], [0])
    examples = [{c: out[c][i] for c in out} for i in range(2)]
    batch = collate(examples, 0, model.tokenizer.pad_token_id)
    with torch.no_grad():
        states = loss.compress_batch(model, batch, Source.model_validate(source("rag_qa", data)))
        for docs, readings, got in zip(batch.documents, batch.readings, states):
            for doc, ratio, state in zip(docs, readings, got):
                want = model.compress([doc], ratio=ratio, adapter=None if ratio == 1 else ENCODER)[0]
                torch.testing.assert_close(state.keys, want.keys)
                assert state.k == want.k


def test_the_teacher_reads_the_gold_passage_alone(data):
    from dataclasses import replace

    from nugget_rag.train.batches import collate
    from nugget_rag.train.distill import Teacher

    model, builder, records = rag_builder(data, gold_compressed=0, no_gold=0)
    out = builder(records[:5], [0])
    batch = collate([{c: out[c][i] for c in out} for i in range(2)], 0, model.tokenizer.pad_token_id)
    gold_only = replace(batch, documents=batch.teacher_documents, teacher_documents=[[], []])
    teacher = Teacher(model)
    torch.testing.assert_close(teacher.target_logits(batch, False), teacher.target_logits(gold_only, False))
    assert all(len(t) == 1 for t in batch.teacher_documents) and all(len(d) == 3 for d in batch.documents)


def test_the_pretraining_stage_trains_two_steps_on_the_tiny_model(tmp_path):
    """configs/pretrain.yaml as it is (autoencoding and continuation, r from {2, 4, 10}, a chain, the Scorer trained),
    its data moved onto tiny files: two steps move the encoder, decoder and Scorer."""
    from dry_run import write

    stage = yaml.safe_load(write(tmp_path / "dry", Path(__file__).parent.parent / "configs" / "pretrain.yaml").read_text())
    trained = TrainConfig.model_validate(stage | {"output_dir": str(tmp_path / "run"), "max_steps": 2})
    assert trained.ratios.choices == [2, 4, 10] and trained.chain and trained.distill.weight == 0
    model = NuggetModel(tiny_base(), trained.nugget)
    before = snapshot(model)
    train(trained, model)
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert any(name.startswith("scorer.") for name in moved) and any("lora_" in name for name in moved), moved


def own_prefix_pass(monkeypatch) -> None:
    """Make the decoder run its prompt prefixes in a pass of their own, as it did before prefix_rows.py."""
    layout = NuggetModel.layout
    monkeypatch.setattr(NuggetModel, "layout", lambda self, *args, in_pass=False, **kwargs: layout(self, *args, **kwargs))


@pytest.mark.parametrize("settings", [{}, {"attention": "fused"}, {"gradient_checkpointing": True}],
                         ids=["reference", "fused", "checkpointed"])
def test_the_prompt_prefix_as_rows_of_the_decoders_pass_gives_its_own_passs_loss_and_gradients(
        settings, data, tmp_path, monkeypatch):
    """Under autograd each distinct prompt prefix runs as one row of the decoder's pass (prefix_rows.py) rather than
    in a pass of its own: the same loss and gradients for a distilled QA micro-batch (the prefix: the chat template's
    opening), with both attention paths and gradient checkpointing."""
    results = {}
    for arm in ("rows", "own_pass"):
        if arm == "own_pass":
            own_prefix_pass(monkeypatch)
        trainer = Trainer(config(tmp_path / arm, [source("qa", data)], batch_size=3, distill={"weight": 0.5},
                                 **settings), perturb_adapters(tiny_model()))
        trainer.model.train()
        batch = trainer.mixture.next_batch()
        assert all(batch.prefixes) and len({tuple(p) for p in batch.prefixes}) == 1
        results[arm] = trainer._backward([batch])[0][0], gradients(trainer.model)
    (rows_loss, rows), (own_loss, own) = results["rows"], results["own_pass"]
    assert rows_loss == pytest.approx(own_loss, rel=1e-6)
    assert own and rows.keys() == own.keys() and any(f".{DECODER}." in name for name in own)
    for name in own:
        torch.testing.assert_close(rows[name], own[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attention_path", ["reference", "fused"])
def test_distinct_prompt_prefixes_read_in_the_pass_as_after_their_own_pass(attention_path, monkeypatch):
    """Samples with different prefixes (one longer than the decoder's tokens, one empty) and a soft prompt: logits,
    loss and every gradient as with the prefixes run in a pass of their own."""
    tok, results = tiny_model().tokenizer, {}
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ("the cat sat on the mat", "dogs ran far", "sky")]
    opening = tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    prefixes = [opening, tok("System: be brief and kind.\n", add_special_tokens=False)["input_ids"] + opening, []]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("\n\nWho sat?", "\n\nWho ran?", "\n\nSky?")]
    width = max(map(len, prompts))
    input_ids = torch.tensor([p + [tok.pad_token_id] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[i < len(p) for i in range(width)] for p in prompts])
    for arm in ("rows", "own_pass"):
        if arm == "own_pass":
            own_prefix_pass(monkeypatch)
        model = perturb_adapters(tiny_model())
        model.attention = attention_path
        states = model.compress(ids)
        out = model.decode([[states[0], states[2]], [states[1]], [states[2]]], input_ids, mask,
                           labels=input_ids.masked_fill(~mask, -100), soft_prompt=True, prefixes=prefixes)
        out.loss.backward()
        results[arm] = out, gradients(model)
    (rows, rows_grads), (own, own_grads) = results["rows"], results["own_pass"]
    assert len(prefixes[1]) > width
    torch.testing.assert_close(rows.logits, own.logits, rtol=1e-5, atol=1e-5)
    assert float(rows.loss.detach()) == pytest.approx(float(own.loss.detach()), rel=1e-6)
    assert rows_grads.keys() == own_grads.keys() and "soft_prompt" in own_grads
    for name in own_grads:
        torch.testing.assert_close(rows_grads[name], own_grads[name], rtol=1e-5, atol=1e-6)


def test_a_distilled_step_runs_no_pass_for_the_prompt_prefix(data, tmp_path, monkeypatch):
    """The LLaMA's passes in a distilled QA micro-batch after the first: before, four (encoder, the decoder's prompt
    prefix, decoder, teacher over prefix + documents + decoder tokens); now three, the prefix one row of the
    decoder's pass and the teacher reading the frozen model's states of it, kept since the first step."""
    from nugget_rag.train.distill import Teacher

    counted = {}
    for arm in ("now", "before"):
        if arm == "before":
            own_prefix_pass(monkeypatch)
            monkeypatch.setattr(Teacher, "keeps_prefixes", lambda self, *args: False)
        trainer = Trainer(config(tmp_path / arm, [source("qa", data)], batch_size=4, distill={"weight": 0.5}),
                          tiny_model())
        passes = []  # (rows, width) of every pass of the inner LLaMA
        trainer.model.llama.model.register_forward_hook(
            lambda module, args, kwargs, out: passes.append(tuple(out.last_hidden_state.shape[:2])), with_kwargs=True)
        trainer.model.train()
        trainer._backward([trainer.mixture.next_batch()])
        passes.clear()
        batch = trainer.mixture.next_batch()
        trainer._backward([batch])
        counted[arm] = list(passes)
    prefix = len(batch.prefixes[0])
    assert prefix > 0 and all(len(p) == prefix for p in batch.prefixes)
    (encoder, decoder, teacher), (encoder_before, own, decoder_before, teacher_before) = counted["now"], counted["before"]
    assert encoder == encoder_before and own == (1, prefix)  # the prefix's own pass: one row, dropped
    assert decoder == (4 + 1, max(decoder_before[1], prefix))  # the samples' rows and one for their shared prefix
    assert teacher == (4, teacher_before[1] - prefix)  # the teacher runs no prefix in any row


@pytest.mark.parametrize("name", ["qa", "rag_qa"])
def test_packed_documents_give_the_padded_loss_and_gradients(name, data, tmp_path):
    """`packing` puts several documents in each row of the Scorer's and the encoder's passes, each attending to
    itself alone from position 0: the loss and every gradient (encoder, decoder, Scorer, soft prompt) are the
    padded run's, distilled, for fewer positions computed."""
    results = {}
    for packing in (False, True):
        trainer = Trainer(config(tmp_path / str(packing), [source(name, data)], batch_size=4, distill={"weight": 0.5},
                                 lengths={**LENGTHS, "document": 96}, packing=packing), perturb_adapters(tiny_model()))
        passes = []  # (rows, width) of every pass of the inner LLaMA
        trainer.model.llama.model.register_forward_hook(
            lambda module, args, kwargs, out: passes.append(tuple(out.last_hidden_state.shape[:2])), with_kwargs=True)
        trainer.model.train()
        batch = trainer.mixture.next_batch()
        results[packing] = trainer._backward([batch])[0][0], gradients(trainer.model), passes
    (loss_value, grads, padded), (packed_loss, packed_grads, packed) = results[False], results[True]
    assert packed_loss == pytest.approx(loss_value, rel=1e-6)
    assert grads.keys() == packed_grads.keys() and any(f".{ENCODER}." in n or n.startswith("scorer.") for n in grads)
    for key in grads:
        torch.testing.assert_close(packed_grads[key], grads[key], rtol=1e-5, atol=1e-6)
    assert batch.packed_tokens <= batch.padded_tokens
    assert sum(r * w for r, w in packed) <= sum(r * w for r, w in padded)


@pytest.mark.parametrize("ranked", [False, True])
def test_packed_documents_compress_to_the_padded_states_in_fewer_rows(ranked):
    """Documents of different lengths, packed first-fit into rows of the longest's width: the same nugget positions,
    scores, keys and values as one document a row, from 3 rows instead of 5."""
    from nugget_rag.train.batches import collate

    model = perturb_adapters(tiny_model())
    texts = ["the cat sat on the mat and looked around at all the things", "dogs ran", "blue skies over the hills",
             "a", "green hills under blue skies while dogs ran far away"]
    docs = [model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    passes = []
    model.llama.model.register_forward_hook(
        lambda module, args, kwargs, out: passes.append(tuple(out.last_hidden_state.shape[:2])), with_kwargs=True)
    padded, packed = model.compress(docs, ranked=ranked), model.compress(docs, ranked=ranked, packed=True)
    assert [rows for rows, _ in passes] == [5, 3]
    for a, b in zip(padded, packed):
        assert torch.equal(a.positions, b.positions) and a.fingerprint == b.fingerprint
        for x, y in [(a.keys, b.keys), (a.values, b.values), (a.scores, b.scores)]:
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    batch = collate([{"documents": [d], "input_ids": [5, 6], "target_start": 1, "references": [], "prefix": []}
                     for d in docs], 0, model.tokenizer.pad_token_id)
    longest = max(map(len, docs))
    assert (batch.padded_tokens, batch.packed_tokens) == (5 * longest + 10, 3 * longest + 10)


def training_record(export: Path) -> dict:
    return json.loads((export / "nugget_config.json").read_text())["training"]


def test_a_chain_appends_to_the_lineage_and_counts_on(data, tmp_path):
    """Each run of a chain (init_from the previous export) appends a segment; the totals go on across runs, from an
    export without a lineage (one segment of its steps) too."""
    sources = [source("autoencoding", data)]
    first = train(config(tmp_path / "a", sources, max_steps=3), tiny_model())
    record = training_record(first.final_dir)
    assert [s["updates"] for s in record["lineage"]] == [3] and record["examples"] == 3 * 2
    assert record["tokens"] > 0 and len(record["lineage"][0]["sources"][0]["sha"]) == 12
    second = train(config(tmp_path / "b", sources, max_steps=5, init_from=str(first.final_dir), chain=True),
                   tiny_model())
    record = training_record(second.final_dir)
    assert record["steps"] == 2 and [s["updates"] for s in record["lineage"]] == [3, 2]
    assert record["updates"] == 5 and record["chain_updates"] == 5 and record["examples"] == 5 * 2
    assert record["tokens"] == sum(s["tokens"] for s in record["lineage"])
    assert record["lineage"][1]["settings"]["lr"] == 1e-3 and record["lineage"][1]["device"] == "cpu"
    lines = [json.loads(x) for x in (tmp_path / "b" / "run" / METRICS_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "setup" and x["first_update_s"] > 0] == [1]
    # an export from before lineages: one earlier segment of its steps, its examples unknown
    legacy = tmp_path / "legacy"
    shutil.copytree(first.final_dir, legacy)
    meta = json.loads((legacy / "nugget_config.json").read_text())
    meta["training"] = {k: meta["training"][k] for k in ("steps", "ratios", "objectives", "distill")}
    (legacy / "nugget_config.json").write_text(json.dumps(meta))
    third = train(config(tmp_path / "c", sources, max_steps=5, init_from=str(legacy), chain=True), tiny_model())
    record = training_record(third.final_dir)
    assert [s["updates"] for s in record["lineage"]] == [3, 2] and record["updates"] == 5
    assert record["examples"] is None and record["lineage"][1]["examples"] == 4


def test_export_every_writes_a_candidate_at_each_multiple_of_the_chains_updates(data, tmp_path):
    """export_every counts the chain's updates: a run continuing a 3-update export to 8 exports at 4 and 6 (each
    with its own lineage) and its final at 8, and the candidates load as checkpoints."""
    sources = [source("autoencoding", data)]
    first = train(config(tmp_path / "a", sources, max_steps=3), tiny_model())
    second = train(config(tmp_path / "b", sources, max_steps=8, init_from=str(first.final_dir), chain=True,
                          export_every=2), tiny_model())
    assert sorted(p.name for p in second.output_dir.glob("export-*")) == ["export-4", "export-6"]
    assert [s["updates"] for s in training_record(second.output_dir / "export-4")["lineage"]] == [3, 1]
    assert training_record(second.output_dir / "export-6")["updates"] == 6
    assert training_record(second.final_dir)["updates"] == 8
    NuggetModel.from_pretrained(second.output_dir / "export-6", base_model=tiny_base())


def test_a_chain_continues_the_learning_rate_schedule(data, tmp_path):
    """With chain, a run from an export goes on along the schedule of the whole chain: no second warm-up."""
    sources, optim = [source("autoencoding", data)], {"warmup_steps": 2, "lr": 1e-3}
    straight = train(config(tmp_path / "a", sources, max_steps=6, optim=optim), tiny_model())
    first = train(config(tmp_path / "b", sources, max_steps=3, optim=optim), tiny_model())
    chained = train(config(tmp_path / "c", sources, max_steps=6, optim=optim, init_from=str(first.final_dir),
                           chain=True), tiny_model())
    assert chained.step == 3
    assert [x["lr"] for x in chained.losses] == pytest.approx([x["lr"] for x in straight.losses][3:])
    with pytest.raises(ValueError, match="already holds 3 updates.*raise max_steps above 3"):
        Trainer(config(tmp_path / "d", sources, max_steps=3, init_from=str(first.final_dir), chain=True),
                tiny_model())


def test_each_call_of_a_chain_draws_its_own_data_order(data, tmp_path):
    """A chained call does not read its predecessor's examples again in the same order; two starts of the same call
    (a call re-run on a fresh machine) draw the same order."""
    sources = [source("autoencoding", data)]
    first = train(config(tmp_path / "a", sources, max_steps=3), tiny_model())

    def first_batches(name: str, chain: bool) -> list:
        trainer = Trainer(config(tmp_path / name, sources, max_steps=9, init_from=str(first.final_dir), chain=chain),
                          tiny_model())
        return [trainer.mixture.next_batch().documents for _ in range(3)]

    assert first_batches("b", chain=True) == first_batches("c", chain=True)
    assert first_batches("b", chain=True) != first_batches("d", chain=False)


def test_init_from_adapters_of_another_shape_is_refused_by_name(data, tmp_path):
    NuggetModel(tiny_base(), NuggetConfig(**{**NUGGET, "lora": {"rank": 8}})).save_pretrained(tmp_path / "old")
    with pytest.raises(ValueError, match=r"lora.rank=8 \(the config: 4\).*set nugget.lora"):
        Trainer(config(tmp_path, [source("qa", data)], init_from=str(tmp_path / "old")), tiny_model())


def test_init_from_another_base_model_is_refused(data, tmp_path):
    NuggetModel(tiny_base(seed=1), NuggetConfig(**NUGGET)).save_pretrained(tmp_path / "old")
    with pytest.raises(ValueError, match="whose weights differ"):
        Trainer(config(tmp_path, [source("qa", data)], init_from=str(tmp_path / "old")), tiny_model())


def test_a_chain_refuses_an_export_of_another_stage(data, tmp_path):
    first = train(config(tmp_path / "a", [source("qa", data)], max_steps=1, save_every=1), tiny_model())
    other = [source("autoencoding", data)]
    with pytest.raises(ValueError, match=r"stage objectives=\['qa'\]; the config trains objectives=\['autoencoding'\]"
                                         r".*chain: false"):
        Trainer(config(tmp_path / "b", other, init_from=str(first.final_dir), chain=True), tiny_model())
    with pytest.raises(ValueError, match="lengths="):
        Trainer(config(tmp_path / "b", [source("qa", data)], init_from=str(first.final_dir), chain=True,
                       lengths={**LENGTHS, "document": 40}), tiny_model())
    # another recipe (learning rate, batch size, ratio) continues the chain; chain off begins a new one
    Trainer(config(tmp_path / "b", [source("qa", data)], init_from=str(first.final_dir), chain=True, batch_size=1,
                   optim={"lr": 1e-4}, nugget={**NUGGET, "ratio": 2}), NuggetModel(tiny_base(), NuggetConfig(
                       **{**NUGGET, "ratio": 2})))
    Trainer(config(tmp_path / "c", other, init_from=str(first.final_dir)), tiny_model())


def ready_builder(data, name: str, tokenizer=None):
    from nugget_rag.train.data import ExampleBuilder
    from nugget_rag.train.sources import Lengths

    model = tiny_model()
    spec = Source.model_validate(source(name, data))
    return ExampleBuilder(spec, tokenizer or model.tokenizer, Lengths(**LENGTHS), model.max_positions, 4, 0,
                          in_user_turn=True, teacher_positions=256)


@pytest.mark.parametrize("name", ["qa", "rag_qa", "continuation"])
def test_ready_sets_give_exactly_the_examples_built_fresh(name, data, tmp_path):
    from nugget_rag.train.data import build_examples
    from nugget_rag.train.ready import load_ready, write_ready

    builder = ready_builder(data, name)
    split = builder.source.split
    fresh, skipped = build_examples(builder.source, split, builder, None)
    record = write_ready(tmp_path / "set", fresh, skipped, builder, split)
    loaded, loaded_skipped = load_ready(tmp_path / "set", builder, split)
    assert json.dumps(list(loaded)) == json.dumps(list(fresh))  # ints stay ints, floats floats
    assert loaded_skipped == skipped and record["examples"] == len(fresh)
    assert loaded.features["input_ids"].feature.dtype == "uint16"


def test_a_ready_set_of_another_tokenizer_or_other_settings_is_refused(data, tmp_path):
    from nugget_rag.train.data import build_examples
    from nugget_rag.train.ready import ReadyError, load_ready, write_ready

    builder = ready_builder(data, "qa")
    other = tiny_base().tokenizer
    other.chat_template = other.chat_template.replace("\n", "\n\n")
    theirs = ready_builder(data, "qa", other)
    write_ready(tmp_path / "set", *build_examples(theirs.source, "train", theirs, None), theirs, "train")
    with pytest.raises(ReadyError, match=f"{theirs.tokenizer_digest}.*{builder.tokenizer_digest}.*rebuild"):
        load_ready(tmp_path / "set", builder, "train")
    longer = ready_builder(data, "qa")
    longer.lengths = longer.lengths.model_copy(update={"document": 40})
    write_ready(tmp_path / "set", *build_examples(longer.source, "train", longer, None), longer, "train")
    with pytest.raises(ReadyError, match=r"lengths\.document: 40 -> 48"):
        load_ready(tmp_path / "set", builder, "train")


def test_a_damaged_ready_set_is_refused_by_file(data, tmp_path):
    from nugget_rag.train.data import build_examples
    from nugget_rag.train.ready import ReadyError, load_ready, write_ready

    builder = ready_builder(data, "qa")
    write_ready(tmp_path / "set", *build_examples(builder.source, "train", builder, None), builder, "train")
    arrow = next((tmp_path / "set").glob("data-*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-100])
    with pytest.raises(ReadyError, match=f"{arrow.name}: SHA-256 differs.*re-copy"):
        load_ready(tmp_path / "set", builder, "train")


def test_a_run_given_ready_sets_makes_no_tokenizer_call_for_its_data(tmp_path, monkeypatch, capsys, caplog):
    """configs/pretrain.yaml on the tiny model and data: `--write-ready` tokenises its four sources' train parts (it
    evaluates nothing); the run given them trains without tokenising an example."""
    from dry_run import write

    from nugget_rag.train.data import ExampleBuilder

    stage = write(tmp_path / "dry", Path(__file__).parent.parent / "configs" / "pretrain.yaml")
    assert main(["train", "--config", str(stage), "--output-dir", str(tmp_path / "run"), "--write-ready",
                 str(tmp_path / "ready")]) == 0
    printed = capsys.readouterr().out
    assert "4 ready sets" in printed and "autoencoding-python-3.11-docs-train:" in printed
    assert not (tmp_path / "run").exists()

    def refuse(*args, **kwargs):
        raise AssertionError("a ready run tokenised its data")

    monkeypatch.setattr(ExampleBuilder, "ids", refuse)
    monkeypatch.setattr(ExampleBuilder, "__call__", refuse)
    trained = TrainConfig.model_validate(yaml.safe_load(stage.read_text()) | {
        "output_dir": str(tmp_path / "run"), "max_steps": 1, "eval_generate": 0, "ready_dir": str(tmp_path / "ready")})
    with caplog.at_level("INFO", logger="nugget_rag.train.trainer"):
        assert train(trained, NuggetModel(tiny_base(), trained.nugget)).step == 1
    assert "continuation:python-3.11-docs#3 train" in caplog.text


def test_examples_tokenised_in_several_processes_are_the_ones_one_process_builds(tmp_path):
    """qa draws each example's distractors from its batch of records: the processes split records at batch edges."""
    from nugget_rag.train import data as train_data

    rng = random.Random(1)
    words = "the cat sat on a mat while dogs ran far away into green hills under blue skies".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(12, 30))) for _ in range(600)]
    squad = {"data": [{"title": str(i), "paragraphs": [{"context": t, "qas": [
        {"id": str(i), "question": "Which word comes first?", "answers": [{"text": t.split()[0]}]}]}]}
        for i, t in enumerate(texts)]}
    (tmp_path / "squad.json").write_text(json.dumps(squad))
    builder = ready_builder(tmp_path, "qa")
    one, skipped_one = train_data.build_examples(builder.source, "train", builder, tmp_path / "one", processes=1)
    three, skipped_three = train_data.build_examples(builder.source, "train", builder, tmp_path / "three", processes=3)
    assert len(list((tmp_path / "three").glob("*of3.arrow"))) == 3
    assert json.dumps(list(three)) == json.dumps(list(one)) and skipped_three == skipped_one

"""The evaluation harness on the tiny model: every registered system end to end, outputs, bad input, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from eval_data import PARAGRAPHS, write_data
from tiny import tiny_base

from nugget_rag import NuggetConfig, NuggetModel, cli
from nugget_rag.corpora import DataError
from nugget_rag.eval import SYSTEMS, EvalConfig, Query, run
from nugget_rag.eval import runner as eval_runner
from nugget_rag.eval.systems import Env, get_system
from nugget_rag.eval.systems.peers import peer_python
from nugget_rag.eval.systems.resolution import PolicyReading
from nugget_rag.eval.tasks import load_task
from nugget_rag.generation.text import first_repeat
from nugget_rag.model.frozen_pass import attention_probs, frozen_pass
from nugget_rag.model.importance import reconstruction_passes

ALL_TASKS = ["squad", "cnndm", "autoencoding", "lm", "hotpotqa", "long_cnndm"]
KIND = {"squad": "qa", "cnndm": "summarization", "autoencoding": "autoencoding", "lm": "lm", "hotpotqa": "qa",
        "long_cnndm": "summarization"}


def tiny_model(seed: int = 0) -> NuggetModel:
    return NuggetModel(tiny_base(seed), NuggetConfig(ratio=4, scorer_layer=2, lora={"rank": 4}))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


def config(data_dir: Path, out_dir: Path | None, **overrides) -> EvalConfig:
    values = {
        "tasks": ALL_TASKS, "task_splits": {"hotpotqa": "test"}, "ratios": [4], "data_dir": data_dir, "limit": 1,
        "ae_lengths": [70], "ae_max_new_tokens": 8, "lm": {"history": 40, "context": 10, "target": 10},
        "qa_max_new_tokens": 6, "summary_max_new_tokens": 6, "batch_size": 2, "out_dir": out_dir, "progress": False,
        "plots": False, "speed": {"documents": [1, 2], "doc_tokens": 40, "repeats": 1, "decode_steps": 3},
        "checkpoint": None, "long_articles": 2,
    }
    values.update(overrides)
    return EvalConfig(**values)


@pytest.fixture(scope="module")
def peer_base(tmp_path_factory):
    """A directory holding the tiny base model, for the peer packages (when their environment exists)."""
    folder = tmp_path_factory.mktemp("tiny-base")
    base = tiny_base()
    base.model.save_pretrained(folder)
    base.tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_every_registered_system_runs_end_to_end(name, model, data_dir, peer_base, tmp_path):
    """Each system on every task it supports: a scored row with finite metrics, or a stated reason it cannot run."""
    full_model = tiny_model(seed=1) if name == "full_ft" else None
    results = run(config(data_dir, None, systems=[name]), model=model, full_model=full_model, base_model_path=peer_base)
    system = SYSTEMS[name]
    unavailable = system().available(Env(model=model, full_model=full_model, base_model_path=peer_base))
    rows = {r["task"]: r for r in results["results"]}
    assert set(rows) == set(ALL_TASKS)
    for task, row in rows.items():
        if KIND[task] not in system.kinds:
            assert row["status"] == "n/a"
        elif unavailable is not None:
            assert row["status"] == "unavailable" and row["reason"] == unavailable
        else:
            assert row["status"] == "ok", row
            assert row["scored"] + sum(row["skipped"].values()) == row["examples"] >= 1
            assert not any(reason.startswith("peer error") for reason in row["skipped"]), row["skipped"]
            if task == "long_cnndm" and not row["scored"]:  # its documents exceed the positions: Full cannot
                assert all(reason.endswith("exceeds the model's positions") for reason in row["skipped"]), row
                continue
            assert row["scored"] >= 1, row
            assert row["metrics"] and all(math.isfinite(v) for v in row["metrics"].values())
            if (system.uses_ratio and row.get("kept_slots") and name not in ("lmsumm", "llmlingua")
                    and not issubclass(system, PolicyReading)):  # these read their top passage whole
                assert row["achieved_ratio"] == pytest.approx(4, rel=0.35)  # k = ceil(n / r) slots per document
    if name in ("llmlingua", "kvpress_snapkv", "kvpress_snapkv_query", "kvpress_observed_attention") and peer_python(Env(model=model)) is None:
        assert unavailable is not None and "peer environment" in unavailable


def test_outputs_json_markdown_plots_and_benchmarks_section(model, data_dir, tmp_path):
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text("# Benchmarks\n\nHand-written text stays.\n")
    cfg = config(data_dir, tmp_path / "out", systems=["full", "nodoc", "truncation", "nugget"], ratios=[4, 8],
                 ae_lengths=[70, 100], lm={"history": 24, "context": 8, "target": 8},
                 tasks=[*ALL_TASKS, "speed"], plots=True, optimal=True, optimal_examples=1, write_benchmarks=bench,
                 optimal_lm={"history": 24, "context": 8, "target": 8},
                 command="nugget-rag eval --test")
    results = run(cfg, model=model)
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["meta"]["command"] == "nugget-rag eval --test" and saved["meta"]["machine"]
    assert {(r["task"], r["system"], r["ratio"]) for r in saved["results"]} >= {("squad", "nugget", 4.0), ("squad", "nugget", 8.0),
                                                                                ("squad", "full", None)}
    ae = next(r for r in saved["results"] if r["task"] == "autoencoding" and r["system"] == "full")
    assert {"bleu", "bleu@70", "bleu@100"} <= set(ae["metrics"])
    speed = saved["speed"]["rows"][0]
    assert speed["documents"] == 1 and speed["ttft_full_s"] > 0 and speed["nugget"]["4"]["ttft_s"] > 0
    assert speed["nugget"]["4"]["kv_reduction_docs"] == pytest.approx(40 / 10)
    assert 0 <= saved["optimal"]["replaced_share"] <= 1
    assert saved["optimal"]["ppl_optimal"] <= saved["optimal"]["ppl_scorer"] + 1e-6
    md = (tmp_path / "out" / "eval.md").read_text()
    assert "### squad: accuracy" in md and "| r = 4 | r = 8 |" in md and "BLEU by input length" in md
    assert "Speed and memory" in md and "greedy-optimal" in md
    assert f"| 1 | {speed['adaptive']['positions']} |" in md  # the default chain's policy over stored states
    assert "### cnndm: ROUGE-1 / ROUGE-2 / ROUGE-L F1" in md
    assert md.index("### autoencoding") < md.index("### squad") < md.index("### cnndm") < md.index("### lm")
    for plot in results["files"]["plots"]:
        assert Path(plot).stat().st_size > 1000
    assert any(p.endswith("bleu-vs-length.png") for p in results["files"]["plots"])
    assert any(p.endswith("ttft-vs-documents.png") for p in results["files"]["plots"])
    lines = (tmp_path / "out" / "eval-predictions.jsonl").read_text().splitlines()
    assert len(lines) == sum(r.get("scored", 0) for r in saved["results"])
    text = bench.read_text()
    assert "Hand-written text stays." in text and text.count("<!-- nugget-rag eval: begin -->") == 1
    run(cfg.model_copy(update={"tasks": ["squad"], "optimal": False}), model=model)  # a second run replaces it
    again = bench.read_text()
    assert again.count("<!-- nugget-rag eval: begin -->") == 1 and "### cnndm" not in again


def test_speed_times_its_setup_apart_and_can_leave_out_the_policy(model, data_dir, tmp_path):
    """The GPU benchmark's speed part: tokenising and warm-ups reported apart from the measured seconds."""
    cfg = config(data_dir, tmp_path, tasks=["speed"], systems=["nugget"],
                 speed={"documents": [1], "doc_tokens": 40, "repeats": 1, "decode_steps": 3, "policy": False})
    run(cfg, model=model)
    speed = json.loads((tmp_path / "eval.json").read_text())["speed"]
    assert "adaptive" not in speed["rows"][0] and speed["measured_s"] > 0
    assert speed["setup_s"]["model"] is None and speed["setup_s"]["warmups"] > 0  # the model was handed in
    md = (tmp_path / "eval.md").read_text()
    assert "Setup: tokenising the documents" in md and "resolution policy" not in md


def test_examples_that_cannot_run_are_counted_not_dropped(model, tmp_path):
    long = "x" * 600  # the tiny model has 512 positions: Full cannot read it, so no system is scored on it
    squad = {"data": [{"paragraphs": [
        {"context": PARAGRAPHS[0], "qas": [{"id": "ok", "question": "How fast?", "answers": [{"text": "two"}]},
                                          {"id": "noanswer", "question": "Why?", "answers": []}]},
        {"context": long, "qas": [{"id": "long", "question": "What?", "answers": [{"text": "x"}]}]},
        {"context": "", "qas": [{"id": "empty", "question": "What?", "answers": [{"text": "x"}]}]},
    ]}]}
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(squad))
    cfg = config(tmp_path, None, tasks=["squad"], data={"squad": path}, split=None, limit=None,
                 systems=["full", "truncation"])
    results = run(cfg, model=model)
    info = results["tasks"]["squad"]
    assert info["examples"] == 1 and info["examined"] == 4
    assert info["skipped"] == {"no gold answer": 1, "Full prompt + output exceed the model's 512 positions": 1,
                               "empty document": 1}
    assert all(r["examples"] == 1 for r in results["results"])


def test_empty_model_output_is_counted_and_scored_wrong(model, data_dir, monkeypatch):
    monkeypatch.setattr(eval_runner, "generate", lambda model, samples, prompts, *a, **k: [""] * len(prompts))
    results = run(config(data_dir, None, tasks=["squad", "cnndm"], systems=["full"], limit=2), model=model)
    squad, cnndm = results["results"]
    assert squad["empty_outputs"] == squad["scored"] == 2 and squad["metrics"]["accuracy"] == 0.0
    assert cnndm["empty_outputs"] == 2 and cnndm["metrics"]["rouge1"] == 0.0


def test_bad_inputs_give_clear_errors(model, data_dir, tmp_path):
    with pytest.raises(DataError, match="not found"):
        run(config(data_dir, None, tasks=["squad"], data={"squad": tmp_path / "missing.json"}), model=model)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"data": [{"paragraphs": [{"context": "c", "qas": [{"question": "q?"}]}]}]}))
    with pytest.raises(DataError, match="lacks the field"):
        run(config(data_dir, None, tasks=["squad"], data={"squad": broken}, split=None), model=model)
    with pytest.raises(DataError, match="no 'dev' part"):  # HotpotQA has only a test part
        run(config(data_dir, None, tasks=["hotpotqa"], task_splits={}), model=model)
    with pytest.raises(ValueError, match="ratio must be a finite number >= 1"):
        config(data_dir, None, ratios=[0.5])
    with pytest.raises(ValueError, match="unknown system"):
        config(data_dir, None, systems=["nope"])


def test_no_ratio_leaves_zero_slots(model):
    """k = ceil(n / r) >= 1 for any r >= 1, even r far above the document length."""
    ids = model.tokenizer("short", add_special_tokens=False)["input_ids"]
    q = Query("qa", ["short"], [ids], "What?")
    env = Env(model=model)
    for name in ("truncation", "compressive", "observed_attention", "kvzip", "snapkv", "llmlingua_style", "nugget"):
        (reading,) = get_system(name).prepare(env, [q], 1000.0)
        kept = reading.states[0].k if reading.states is not None else len(reading.text_ids[0])
        assert kept == 1, name


def test_compressive_at_r1_is_the_frozen_model_reading_the_document(model):
    """r = 1: every position is its own chunk, so the pooled states are the document's own keys/values and the
    decoder's output equals the base model's over opening + document + prompt (the position scheme is exact)."""
    doc = model.tokenizer("The falcon dives fast.", add_special_tokens=False)["input_ids"]
    prompt = model.tokenizer(" Why?", add_special_tokens=False)["input_ids"]
    (reading,) = get_system("compressive").prepare(Env(model=model), [Query("qa", ["x"], [doc], "Why?")], 1.0)
    with torch.no_grad():
        got = model.decode([reading.states], torch.tensor([prompt]), adapter=None).logits
        with model.use_adapter(None):
            want = model.llama(input_ids=torch.tensor([model.document_opening + doc + prompt])).logits[:, -len(prompt):]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kvzip_keeps_the_documents_own_states_and_scores_its_positions(model):
    """The repeat follows the document, so the kept keys/values are those of the document read alone (cacheable)."""
    doc = model.tokenizer("The falcon dives fast over the river at dawn.", add_special_tokens=False)["input_ids"]
    ((run, scores),) = reconstruction_passes(model, [doc])
    (alone,) = frozen_pass(model, [doc])
    torch.testing.assert_close(run.keys[:, :, : len(doc)], alone.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run.values[:, :, : len(doc)], alone.values, atol=1e-5, rtol=1e-5)
    assert scores.shape == (len(doc),) and bool(((scores > 0) & (scores <= 1)).all())
    (reading,) = get_system("kvzip").prepare(Env(model=model), [Query("qa", ["x"], [doc], "Why?")], 4.0)
    assert reading.states[0].k == math.ceil(len(doc) / 4)
    assert reading.states[0].positions.tolist() == sorted(scores.topk(reading.states[0].k).indices.tolist())


def test_attention_probabilities_from_captured_queries_match_eager_attention():
    # no document opening: the probabilities are over the document's own columns, which eager attention sees alone
    model = NuggetModel(tiny_base(), NuggetConfig(ratio=4, scorer_layer=2, lora={"rank": 4}, placement="before_prompt"))
    ids = model.tokenizer("Nuggets are the tokens kept.", add_special_tokens=False)["input_ids"]
    (run_,) = frozen_pass(model, [ids], queries=True)
    rows = torch.arange(len(ids))
    with torch.no_grad(), model.use_adapter(None):
        saved = model.llama.config._attn_implementation
        model.llama.config._attn_implementation = "eager"
        try:
            eager = model.llama(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        finally:
            model.llama.config._attn_implementation = saved
    for layer in (0, len(eager) - 1):
        torch.testing.assert_close(attention_probs(model, run_, rows, layer), eager[layer][0], atol=1e-5, rtol=1e-4)


def test_task_limit_and_autoencoding_buckets(model, data_dir):
    task = load_task("autoencoding", config(data_dir, None, limit=2, split=None, ae_lengths=[70, 100]), model)
    assert sorted(e.bucket for e in task.examples) == [70, 70, 100, 100]
    assert all(abs(len(e.query.document_ids[0]) - e.bucket) <= 5 for e in task.examples)
    lm = load_task("lm", config(data_dir, None, limit=1), model)
    (ex,) = lm.examples
    assert (len(ex.query.document_ids[0]), len(ex.query.context_ids), len(ex.query.target_ids)) == (40, 10, 10)


def test_sample_random_draws_a_seeded_sample_of_the_split(model, data_dir):
    """--sample random keeps a limit's worth of the split's questions, the same ones for the same seed."""
    def ids(**kw):
        return [e.id for e in load_task("squad", config(data_dir, None, split=None, **kw), model).examples]

    every = ids(limit=None)
    first = ids(limit=3)
    assert first == every[:3]
    drawn = {seed: ids(limit=3, sample="random", sample_seed=seed) for seed in range(6)}
    assert all(len(d) == 3 and set(d) <= set(every) for d in drawn.values())
    assert ids(limit=3, sample="random", sample_seed=2) == drawn[2]
    assert any(d != first for d in drawn.values())
    assert sorted(ids(limit=None, sample="random")) == sorted(every)


def test_qa_finish_sentence_only_extends_the_answers_and_is_part_of_the_setup(model, data_dir):
    hard = run(config(data_dir, None, tasks=["squad"], systems=["full"], limit=2), model=model)
    soft = run(config(data_dir, None, tasks=["squad"], systems=["full"], limit=2, qa_finish_sentence=20), model=model)
    pairs = list(zip(hard["predictions"], soft["predictions"]))
    assert len(pairs) == 2 and all(s["output"].startswith(h["output"]) for h, s in pairs)
    assert soft["tasks"]["squad"]["setup"]["finish_sentence"] == 20 and "finish_sentence" not in hard["tasks"]["squad"]["setup"]


def test_qa_repetition_settings_are_opt_in_and_part_of_the_setup(model, data_dir):
    def answers(**settings) -> dict:
        return run(config(data_dir, None, tasks=["squad"], systems=["full"], limit=2, qa_max_new_tokens=40,
                          **settings), model=model)

    plain, ruled, penalised = answers(), answers(qa_no_repeat_ngram_size=8), answers(qa_repetition_penalty=5.0)
    setups = [r["tasks"]["squad"]["setup"] for r in (plain, ruled, penalised)]
    assert not {"no_repeat_ngram_size", "repetition_penalty"} & set(setups[0])  # the paper's greedy decoding
    assert setups[1]["no_repeat_ngram_size"] == 8 and setups[2]["repetition_penalty"] == 5.0
    outputs = [[p["output"] for p in r["predictions"]] for r in (plain, ruled, penalised)]
    assert any(first_repeat(o, 8) is not None for o in outputs[0])  # the tiny model loops (a token a character)
    assert outputs[1] != outputs[0] and outputs[2] != outputs[0]


def test_only_ids_reruns_some_answers_of_a_run(model, data_dir):
    whole = run(config(data_dir, None, tasks=["squad"], systems=["full"], limit=3), model=model)["predictions"]
    part = run(config(data_dir, None, tasks=["squad"], systems=["full"], limit=3,
                      only_ids=[p["id"] for p in whole[1:]]), model=model)["predictions"]
    assert [(p["id"], p["output"]) for p in part] == [(p["id"], p["output"]) for p in whole[1:]]
    with pytest.raises(DataError, match="names 1 example.*'nope'"):
        run(config(data_dir, None, tasks=["squad"], systems=["full"], limit=3, only_ids=["nope"]), model=model)


def test_keep_ratio_sets_the_resolution_systems_store_floor_and_the_answers_stay(model, data_dir):
    runs = {floor: run(config(data_dir, None, tasks=["squad_rag"], systems=["default_reading"], limit=3,
                              keep_ratio=floor), model=model) for floor in (1.0, 4.0)}
    assert runs[1.0]["tasks"]["squad_rag"]["setup"]["keep_ratio"] == 1.0
    assert "keep_ratio" not in runs[4.0]["tasks"]["squad_rag"]["setup"]  # the default
    assert [p["output"] for p in runs[1.0]["predictions"]] == [p["output"] for p in runs[4.0]["predictions"]]


def test_resume_keeps_matching_cells_and_merges_other_tasks(model, data_dir, tmp_path, monkeypatch):
    """--resume computes only missing cells, carries other tasks' cells into one report, and recomputes a task
    whose setup changed; a run stopped after some cells leaves them saved."""
    out = tmp_path / "out"
    first = config(data_dir, out, tasks=["squad"], systems=["full", "nugget"], ratios=[4], command="first")
    run(first, model=model)
    calls = []
    real = eval_runner.evaluate
    monkeypatch.setattr(eval_runner, "evaluate", lambda env, system, task, ratio, *a: calls.append(
        (task.name, system.name, ratio)) or real(env, system, task, ratio, *a))
    second = first.model_copy(update={"tasks": ["squad", "lm"], "ratios": [4.0, 8.0], "resume": True, "command": "second"})
    results = run(second, model=model)
    assert calls == [("squad", "nugget", 8.0), ("lm", "full", None), ("lm", "nugget", 4.0), ("lm", "nugget", 8.0)]
    saved = json.loads((out / "eval.json").read_text())
    assert {(r["task"], r["system"], r["ratio"]) for r in saved["results"]} == {
        ("squad", "full", None), ("squad", "nugget", 4.0), ("squad", "nugget", 8.0),
        ("lm", "full", None), ("lm", "nugget", 4.0), ("lm", "nugget", 8.0)}
    assert saved["meta"]["commands"] == ["first", "second"]
    md = (out / "eval.md").read_text()
    assert "`first`" in md and "`second`" in md and "| r = 4 | r = 8 |" in md
    predictions = (out / "eval-predictions.jsonl").read_text().splitlines()
    assert len(predictions) == sum(r["scored"] for r in results["results"])

    calls.clear()  # another limit is another setup: squad is recomputed, lm kept
    run(second.model_copy(update={"task_limits": {"squad": 2}, "tasks": ["squad"], "command": "third"}), model=model)
    assert sorted(calls) == [("squad", "full", None), ("squad", "nugget", 4.0), ("squad", "nugget", 8.0)]
    saved = json.loads((out / "eval.json").read_text())
    assert saved["tasks"]["squad"]["examples"] == 2 and saved["tasks"]["lm"]["examples"] == 1
    assert len([r for r in saved["results"] if r["task"] == "lm"]) == 3
    run(second.model_copy(update={"tasks": ["lm"], "systems": ["kvpress_observed_attention"], "command": "n/a"}),
        model=model)  # a system that cannot run a task: its row is carried by later runs of other tasks too
    run(second.model_copy(update={"tasks": ["squad"], "command": "fourth"}), model=model)
    saved = json.loads((out / "eval.json").read_text())
    assert [(r["system"], r["status"]) for r in saved["results"] if r["task"] == "lm"] == [
        ("full", "ok"), ("nugget", "ok"), ("nugget", "ok"), ("kvpress_observed_attention", "n/a")]

    def stop(env, system, task, ratio, *a):  # a run that dies in its second cell
        if calls:
            raise KeyboardInterrupt
        calls.append(system.name)
        return real(env, system, task, ratio, *a)

    calls.clear()
    monkeypatch.setattr(eval_runner, "evaluate", stop)
    with pytest.raises(KeyboardInterrupt):
        run(first.model_copy(update={"name": "stopped"}), model=model)
    partial = json.loads((out / "stopped.json").read_text())
    assert [(r["system"], r["status"]) for r in partial["results"]] == [("full", "ok")]


def test_qa_prompt_is_the_instruction_of_every_qa_task(model, data_dir):
    prompt = "Answer in a few words: {question}"
    for name in ("squad", "squad_rag"):
        default = load_task(name, config(data_dir, None, limit=2), model)
        asked = load_task(name, config(data_dir, None, limit=2, qa_prompt=prompt), model)
        for before, after in zip(default.examples, asked.examples):
            assert after.query.instruction == prompt.format(question=before.query.question) != before.query.instruction
    with pytest.raises(ValueError, match="no {question} placeholder"):
        config(data_dir, None, qa_prompt="Answer briefly.")


def test_task_limits_override_the_global_limit(model, data_dir):
    cfg = config(data_dir, None, limit=1, task_limits={"cnndm": 2})
    assert len(load_task("cnndm", cfg, model).examples) == 2 and len(load_task("squad", cfg, model).examples) == 1
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        config(data_dir, None, task_limits={"nope": 2})


@pytest.fixture
def tiny_eval_cli(monkeypatch, model):
    monkeypatch.setattr(eval_runner, "load_models", lambda cfg: (model, None, None))


def test_cli_eval_smoke(tiny_eval_cli, data_dir, tmp_path, capsys):
    code = cli.main(["eval", "--tasks", "squad", "--systems", "full", "truncation", "nugget", "--ratios", "4",
                     "--data-dir", str(data_dir), "--limit", "3", "--task-limit", "squad=2", "--out-dir", str(tmp_path),
                     "--name", "smoke", "-q"])
    out = capsys.readouterr().out
    assert code == 0 and "### squad: accuracy" in out and "nugget-rag (Dodo)" in out
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["meta"]["command"].startswith("nugget-rag eval --tasks squad")
    assert len(saved["results"]) == 3 and (tmp_path / "smoke-squad-vs-r.png").is_file()
    assert saved["tasks"]["squad"]["examples"] == 2


def test_cli_eval_errors_exit_2(tiny_eval_cli, data_dir, tmp_path, capsys):
    assert cli.main(["eval", "--ratios", "0.5", "--data-dir", str(data_dir), "-q"]) == 2
    assert "ratio must be a finite number >= 1" in capsys.readouterr().err
    assert cli.main(["eval", "--data-dir", str(tmp_path / "nowhere"), "-q", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "Traceback" not in err
    assert cli.main(["eval", "--data-dir", str(data_dir), "-q", "--rag-passages", "0"]) == 2  # never silently the default
    assert "rag_passages" in capsys.readouterr().err


def test_cli_eval_takes_the_repetition_settings_and_an_ids_file(monkeypatch, model, data_dir, tmp_path, capsys):
    seen = []
    monkeypatch.setattr(eval_runner, "load_models", lambda cfg: (seen.append(cfg), (model, None, None))[1])
    common = ["eval", "--tasks", "squad", "--systems", "nodoc", "--data-dir", str(data_dir), "--limit", "2",
              "--out-dir", str(tmp_path), "-q"]
    assert cli.main(common) == 0
    first = json.loads((tmp_path / "eval-predictions.jsonl").read_text().splitlines()[0])["id"]
    (tmp_path / "ids.txt").write_text(f"{first}\n")
    assert cli.main([*common, "--qa-no-repeat-ngram", "6", "--qa-repetition-penalty", "1.1",
                     "--only-ids", str(tmp_path / "ids.txt")]) == 0
    assert (seen[1].qa_no_repeat_ngram_size, seen[1].qa_repetition_penalty, seen[1].only_ids) == (6, 1.1, [first])
    assert [json.loads(line)["id"] for line in (tmp_path / "eval-predictions.jsonl").read_text().splitlines()] == [first]
    (tmp_path / "none.txt").write_text("\n")
    assert cli.main([*common, "--only-ids", str(tmp_path / "none.txt")]) == 2
    assert "lists no id" in capsys.readouterr().err


def test_cli_eval_checkpoint_defaults_to_the_shipped_one(monkeypatch, model, data_dir, tmp_path):
    """Like the rest of the CLI: no --checkpoint reads the shipped adapters, 'none' untrained ones."""
    seen = []
    monkeypatch.setattr(eval_runner, "load_models", lambda cfg: (seen.append(cfg), (model, None, None))[1])
    common = ["eval", "--tasks", "squad", "--systems", "nodoc", "--data-dir", str(data_dir), "--limit", "1",
              "--out-dir", str(tmp_path), "-q"]
    assert cli.main([*common, "--name", "shipped"]) == 0
    assert cli.main([*common, "--name", "untrained", "--checkpoint", "none"]) == 0
    assert [cfg.checkpoint for cfg in seen] == ["default", None]
    shipped = json.loads((tmp_path / "shipped.json").read_text())["meta"]
    untrained = json.loads((tmp_path / "untrained.json").read_text())["meta"]
    assert shipped["adapters"] == "trained" and shipped["checkpoint"] == "default (smollm2-135m-instruct-r10)"
    assert untrained["adapters"] == "untrained" and untrained["checkpoint"] is None


def test_checkpoints_load_for_nugget_and_full_finetuned(peer_base, data_dir, tmp_path):
    """--checkpoint and --full-checkpoint load nugget checkpoints onto --base-model; Full fine-tuned then runs."""
    tiny_model().save_pretrained(tmp_path / "nugget")
    tiny_model().save_pretrained(tmp_path / "full")
    cfg = config(data_dir, None, tasks=["squad"], systems=["full_ft", "nugget"], checkpoint=tmp_path / "nugget",
                 full_checkpoint=tmp_path / "full", base_model=Path(peer_base), device="cpu")
    model, full, base_path = eval_runner.load_models(cfg)
    assert full is not None and full is not model and base_path == peer_base
    results = run(cfg, model=model, full_model=full, base_model_path=base_path)
    assert [r["status"] for r in results["results"]] == ["ok", "ok"]
    assert results["meta"]["adapters"] == "trained" and results["meta"]["full_checkpoint"].endswith("full")


def test_a_checkpoint_retrained_in_place_is_another_setup(model, tmp_path):
    """--resume must not keep cells of a checkpoint whose directory now holds other weights."""
    from nugget_rag.eval.resume import weights_sha256

    model.save_pretrained(tmp_path / "ckpt")
    before = weights_sha256(tmp_path / "ckpt")
    with torch.no_grad():
        model.soft_prompt.add_(1.0)
    model.save_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        model.soft_prompt.sub_(1.0)
    assert weights_sha256(tmp_path / "ckpt") != before and weights_sha256(None) is None


def test_lmsumm_keeps_each_summary_within_its_own_budget(model):
    """A short document's summary budget must not grow with the longer documents that share its batch; a document
    longer than half the positions is summarised in chunks (map-reduce)."""
    from nugget_rag.eval.systems.lmsumm import summary_words

    short, long = "The falcon dives.", " ".join(["The falcon dives fast over the river valley."] * 3)
    too_long = " ".join([long] * 6)
    queries = [Query("qa", [d], [model.tokenizer(d, add_special_tokens=False)["input_ids"]], "What?")
               for d in (short, long, too_long)]
    readings = get_system("lmsumm").prepare(Env(model=model, batch_size=3), queries, 4.0)
    summary = readings[0].texts[0]
    assert len(model.tokenizer(summary, add_special_tokens=False)["input_ids"]) <= 2 * summary_words(short, 4.0) + 16
    assert readings[1].texts is not None and "chunks" not in readings[1].info
    assert readings[2].texts is not None and readings[2].info["chunks"] == -(-len(queries[2].document_ids[0]) // 256)


def test_cli_eval_writes_into_a_new_temporary_folder_unless_told(tiny_eval_cli, data_dir, tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = ["eval", "--tasks", "squad", "--systems", "nodoc", "--data-dir", str(data_dir), "--limit", "1", "-q"]
    assert cli.main(common) == 0
    written = Path(capsys.readouterr().out.split("wrote ")[-1].split(",")[0])
    assert written.is_file() and written.parent.name.startswith("nugget-rag-eval-") and not list(tmp_path.iterdir())
    assert cli.main([*common, "--resume"]) == 2
    assert "--out-dir" in capsys.readouterr().err


def test_all_systems_by_default_includes_a_newly_registered_one():
    from nugget_rag.eval.systems import SYSTEMS, Reading, System, register

    @register("test_only_system")
    class TestOnly(System):
        label = "test only"

        def prepare(self, env, queries, ratio):
            return [Reading(texts=list(q.documents)) for q in queries]

    try:
        assert EvalConfig().systems[-1] == "test_only_system" and EvalConfig().systems[0] == "full"
    finally:
        SYSTEMS.pop("test_only_system")


def test_streaming_llm_keeps_the_sinks_and_the_most_recent_tokens():
    from nugget_rag.eval.systems.streaming_llm import sinks_and_recent

    assert sinks_and_recent(list(range(20)), 6) == [0, 1, 2, 3, 18, 19]
    assert sinks_and_recent(list(range(20)), 3) == [0, 1, 2]
    assert sinks_and_recent(list(range(5)), 9) == [0, 1, 2, 3, 4]

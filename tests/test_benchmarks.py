"""The benchmark and helper scripts' own logic (benchmarks/ and scripts/ are not packages: loaded by path)."""

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import tiny_base

from nugget_rag.config import DECODER

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
SCRIPTS = Path(__file__).parent.parent / "scripts"


def load_script(name: str, folder: Path = BENCHMARKS):
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
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
    assert list(result["rows"]) == ["Full (adapters off)", *overhead.MODES, *overhead.INT8]
    assert all(row["ttft_s"] > 0 and row["decode_s_per_token"] > 0 for row in result["rows"].values())
    assert result["nuggets"] == 2 * 6 and model.merged_adapters == (DECODER,) and model.merged_format == "float"
    narrow = overhead.narrowed(tiny_base(layers=3), 16)
    assert narrow.model.config.hidden_size == 16 and narrow.model.config.num_hidden_layers == 3


def test_teacher_answers_keep_correct_ones_cut_at_a_sentence(monkeypatch, make_model, tmp_path):
    teacher = load_script("teacher_answers", SCRIPTS)
    assert teacher.kept_answer("It was Paris.", ["London"], truncated=False) is None
    assert teacher.kept_answer(" Paris is the capital. ", ["paris"], truncated=False) == "Paris is the capital."
    assert teacher.kept_answer("Paris is big, and", ["Paris"], truncated=False) == "Paris is big, and"
    # cut off by the token limit: the longest whole sentences with a gold answer, or nothing
    cut = "Paris is the capital. It is big. It has the Louvre and"
    assert teacher.kept_answer(cut, ["Paris"], truncated=True) == "Paris is the capital. It is big."
    assert teacher.kept_answer("It is big. Paris has the Louvre and", ["Paris"], truncated=True) is None
    assert teacher.kept_answer("1. Paris 2. London and", ["Paris"], truncated=True) is None  # no list numbers

    model = make_model()
    records = [{"id": str(i), "context": f"Passage {i} about cats.", "question": f"Question {i}?",
                "answers": ["cats"]} for i in range(5)]
    answered = list(teacher.teacher_answers(model, records, batch_size=2, max_new_tokens=3))
    assert sorted(r["id"] for r, _, _ in answered) == [r["id"] for r in records]
    assert all(isinstance(text, str) and isinstance(cut, bool) for _, text, cut in answered)

    # main(): keeps the answers with a gold answer, and a re-run asks only the questions not asked yet
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps({"data": [{"paragraphs": [{"context": r["context"], "qas": [
        {"id": r["id"], "question": r["question"], "answers": [{"text": "cats"}]}]} for r in records]}]}))
    asked = []

    def fake_answers(model, todo, batch_size, max_new_tokens):
        asked.extend(r["id"] for r in todo)
        return ((r, "They are cats." if int(r["id"]) % 2 else "Dogs.", False) for r in todo)

    monkeypatch.setattr(teacher, "teacher_answers", fake_answers)
    monkeypatch.setattr(teacher.NuggetModel, "from_pretrained", lambda *a, **k: model)
    out = tmp_path / "teacher.jsonl"
    teacher.main(["--squad", str(squad), "--split", "train", "--n", "3", "--out", str(out)])
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(asked) == 3 and {r["id"] for r in first} == {i for i in asked if int(i) % 2}
    assert all(r["answers"] == ["They are cats.", "cats"] for r in first)  # target, then the gold references
    rejected = [json.loads(line) for line in teacher.rejected_path(out).read_text().splitlines()]
    assert {r["id"] for r in rejected} == {i for i in asked if not int(i) % 2}
    assert all(r["reason"] == "no gold answer" for r in rejected)
    with out.open("a") as f:  # a run killed mid-line
        f.write('{"id": "half-writ')
    teacher.main(["--squad", str(squad), "--split", "train", "--out", str(out)])
    assert sorted(asked) == [r["id"] for r in records]  # every question asked exactly once over both runs
    kept = [json.loads(line) for line in out.read_text().splitlines()]  # the half-written line is gone
    assert sorted(r["id"] for r in kept) == ["1", "3"]

    # --skip: `--n 2` and `--n 4 --skip 2` side by side write what `--n 2`, then a re-run with `--n 4`, writes
    asked.clear()
    grown, head, tail = (tmp_path / f"{name}.jsonl" for name in ("grown", "head", "tail"))
    for n, out in (("2", grown), ("4", grown), ("2", head)):
        teacher.main(["--squad", str(squad), "--split", "train", "--n", n, "--out", str(out)])
    teacher.main(["--squad", str(squad), "--split", "train", "--n", "4", "--skip", "2", "--out", str(tail)])
    assert asked[4:] == asked[:4]  # the two parts ask the draw's questions once each, in the same order
    assert grown.read_text() == head.read_text() + tail.read_text()
    with pytest.raises(SystemExit):  # a skip past the draw asks nothing
        teacher.main(["--squad", str(squad), "--split", "train", "--n", "2", "--skip", "2", "--out", str(tail)])


def test_teacher_summaries_keep_one_whole_sentence():
    teacher = load_script("teacher_summaries", SCRIPTS)
    assert teacher.kept_summary(" The cat sat on the mat. It was red.") == ("The cat sat on the mat.", "")
    assert teacher.kept_summary('He said "it is over for now."') == ('He said "it is over for now."', "")
    assert teacher.kept_summary("   ") == (None, "empty")
    assert teacher.kept_summary("The cat sat on the mat and then") == (None, "no sentence end")  # the limit cut it
    assert teacher.kept_summary("The U.S. army said it would go.") == (None, "fragment")  # cut at "U.S."
    assert teacher.kept_summary("The cat sat, the cat sat, the cat sat.") == (None, "repetition")
    assert teacher.kept_summary("He won the cup in May, and he won the cup in May again.") == (None, "repetition")
    kept = "A fan has become a star, and her son has become a fan of hers."  # a 3-gram twice: not a loop
    assert teacher.kept_summary(kept) == (kept, "")
    # the summary chain's own budget and repeat setting
    assert (teacher.MAX_NEW_TOKENS, teacher.FINISH_SENTENCE, teacher.SECTION_TOKENS) == (32, 32, 512)


def test_teacher_summaries_read_the_chains_sections_of_train_articles(compressor, tiny_model, tmp_path):
    from langchain_core.documents import Document

    from nugget_rag.integrations import NuggetSummarizer

    teacher = load_script("teacher_summaries", SCRIPTS)
    tok = tiny_model.tokenizer
    text = "\n\n".join(f"Paragraph {i}: the cat sat on the mat while dogs ran far away." for i in range(8))
    cut = teacher.sections(tok, text, 120)
    chain = NuggetSummarizer(compressor=compressor, section_tokens=120).sections([Document(page_content=text)])
    assert cut == [s.page_content for s in chain] and len(cut) > 2
    assert all(len(tok(s)["input_ids"]) <= 120 for s in cut)

    # CNN/DM: the train part only, every section of each article
    cnndm = tmp_path / "cnn.jsonl"
    cnndm.write_text("".join(json.dumps({"article": f"{part} article {i}. " + text, "highlights": "h"}) + "\n"
                             for i, part in enumerate(["train", "train", "train", "dev", "test"])))
    (tmp_path / "splits.json").write_text(json.dumps({"cnn.jsonl": {"unit": "line index", "train": [0, 3],
                                                                     "dev": [3, 4], "test": [4, 5]}}))
    records = teacher.cnndm_sections(tok, cnndm, None, 0, section_tokens=120)
    assert {r["id"].rsplit(":", 1)[0] for r in records} == {"cnndm:0", "cnndm:1", "cnndm:2"}
    assert len(records) == 3 * len(teacher.sections(tok, "train article 0. " + text, 120))
    assert not any("dev" in r["document"] or "test" in r["document"] for r in records)
    assert len({r["id"].rsplit(":", 1)[0] for r in teacher.cnndm_sections(tok, cnndm, 2, 0, section_tokens=120)}) == 2
    with pytest.raises(ValueError, match="train part only"):
        teacher.cnndm_sections(tok, cnndm, None, 0, split="dev")

    # the corpus: one section of each document drawn; a larger draw keeps the smaller one's sections
    corpus = tmp_path / "corpus" / "shard.jsonl"
    corpus.parent.mkdir()
    corpus.write_text("".join(json.dumps({"text": f"Document {i}. " + text}) + "\n" for i in range(6)))
    two, four = (teacher.corpus_sections(tok, corpus, n, 0, section_tokens=120) for n in (2, 4))
    assert len(two) == 2 and four[:2] == two and len({r["id"].split(":")[1] for r in four}) == 4
    assert all(r["source"] == "corpus" and r["document"] in teacher.sections(
        tok, f"Document {r['id'].split(':')[1]}. " + text, 120) for r in four)

    # Full reads each section: greedy, a line break stops it
    answered = list(teacher.teacher_summaries(tiny_model, records[:3], batch_size=2, max_new_tokens=3))
    assert sorted(r["id"] for r, _ in answered) == sorted(r["id"] for r in records[:3])
    assert all(isinstance(t, str) and "\n" not in t for _, t in answered)


def test_teacher_summaries_write_a_summarization_source(monkeypatch, tiny_model, tmp_path):
    """main(): kept and rejected sections, a re-run reads only new ones, and the file trains as `summarization`
    (document/summary fields), every 20th line held out as dev."""
    from nugget_rag.train.data import ExampleBuilder, build_examples
    from nugget_rag.train.records import load_records
    from nugget_rag.train.sources import Lengths, Source

    teacher = load_script("teacher_summaries", SCRIPTS)
    cnndm = tmp_path / "data" / "cnn.jsonl"
    cnndm.parent.mkdir()
    cnndm.write_text("".join(json.dumps({"article": f"Article {i} is about cats and dogs.", "highlights": "h"}) + "\n"
                             for i in range(50)))
    asked = []

    def fake(model, todo, batch_size, max_new_tokens):
        asked.extend(r["id"] for r in todo)
        return ((r, f"It is about {r['id']} and its cats. More." if int(r["id"].split(":")[1]) % 5 else "Cats")
                for r in todo)

    monkeypatch.setattr(teacher, "teacher_summaries", fake)
    monkeypatch.setattr(teacher.NuggetModel, "from_pretrained", lambda *a, **k: tiny_model)
    out = tmp_path / "summ" / "teacher-summaries.jsonl"
    teacher.main(["--cnndm", str(cnndm), "--n-cnndm", "10", "--out", str(out)])
    teacher.main(["--cnndm", str(cnndm), "--out", str(out)])
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    rejected = [json.loads(line) for line in teacher.rejected_path(out).read_text().splitlines()]
    assert len(asked) == len(set(asked)) == 48  # the train part (no splits.json: every 20th line is dev), once each
    assert {r["reason"] for r in rejected} == {"no sentence end"} and len(kept) + len(rejected) == 48
    assert all(r["summary"] == f"It is about {r['id']} and its cats." and r["source"] == "cnndm" for r in kept)
    assert set(kept[0]) == {"id", "source", "document", "summary"}

    source = Source(objective="summarization", path=str(out), document_field="document", summary_field="summary",
                    documents_per_example=3)
    assert len(load_records(source, "train")) + len(load_records(source, "dev")) == len(kept)
    assert len(load_records(source, "dev")) == len(kept) // 20 > 0
    builder = ExampleBuilder(source, tiny_model.tokenizer, Lengths(document=64, answer=64), tiny_model.max_positions,
                             4, 0, in_user_turn=True)
    examples, skipped = build_examples(source, "train", builder, None)
    assert not skipped and {len(d) for d in examples["documents"]} == {3}
    with pytest.raises(SystemExit):
        teacher.main(["--out", str(out)])  # nothing to read


def test_offline_bundle_parts_join_back_byte_for_byte(tmp_path):
    bundle = load_script("offline_bundle", SCRIPTS)
    files = {"wheels/big.whl": bytes(range(256)) * 41, "wheels/small.whl": b"tiny", "notes.txt": b"x" * 3000}
    for name, data in files.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_bytes(data)
    parts = bundle.pack(tmp_path / "src", [tmp_path / "src" / n for n in files], tmp_path / "parts", part_mb=4096 / 2**20)
    sizes = [sum(f.stat().st_size for f in d.iterdir() if f.name != "manifest.json") for d in (tmp_path / "parts").iterdir()]
    assert parts == 4 and max(sizes) <= 4096 and sum(sizes) == sum(map(len, files.values()))
    folders = [tmp_path / "parts" / str(n) for n in range(1, parts + 1)]
    bundle.join(folders[::-1], tmp_path / "joined")
    assert all((tmp_path / "joined" / name).read_bytes() == data for name, data in files.items())
    with pytest.raises(SystemExit, match="pass all 4 part folders"):
        bundle.join(folders[:1], tmp_path / "again")
    with pytest.raises(SystemExit, match="SHA-256"):
        bundle.join(folders[:3], tmp_path / "again")  # every file has a piece, the last one lacks its tail


def test_step_ops_counts_each_part_and_restores_the_methods(make_model):
    step_ops = load_script("step_ops")
    model = make_model()
    score = type(model).score
    counter = step_ops.OpCounter()
    with counter, step_ops.attributed(counter.inside):
        model.compress([[5, 6, 7, 8, 9]], ratio=2)
    assert counter.counts["scorer"] > 0 and counter.counts["encoder"] > 0
    assert set(counter.counts) <= {"scorer", "encoder", "other"}
    assert type(model).score is score


def test_the_bundle_carries_every_module_the_gpu_scripts_import():
    """Every distribution behind what the GPU scripts import (offline_bundle.GPU_MODULES, as loaded here) is carried
    by the bundle or held by the GPU image; a distribution the bundle dropped is named."""
    bundle = load_script("offline_bundle", SCRIPTS)
    probe = ("import json, sys; sys.path.insert(0, 'scripts'); import offline_bundle as b; "
             "missing = b.check_imports(b.GPU_MODULES); assert not missing, missing; "
             "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=SCRIPTS.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert "sacrebleu" in loaded and "datasets" in loaded
    carried = set(bundle.requirements())
    assert bundle.uncovered(loaded, carried, bundle.IMAGE_HAS) == []
    assert bundle.uncovered(loaded, carried - {"sacrebleu"}, bundle.IMAGE_HAS - {"sacrebleu"}) == ["sacrebleu"]
    retrieval = set(bundle.requirements(("train", "eval", "retrieval"))) | {bundle.RETRIEVAL_WHEEL}
    assert bundle.uncovered([m.split(".")[0] for m in bundle.RETRIEVAL_MODULES], retrieval, bundle.IMAGE_HAS) == []
    assert bundle.uncovered(["faiss"], carried, bundle.IMAGE_HAS) == ["faiss-cpu"]  # only --retrieval carries it


def test_paired_bleu_pairs_the_same_passage_at_the_same_ratio(tmp_path, capsys, monkeypatch):
    paired = load_script("paired_bleu")
    ref = "the quick brown fox jumps over the lazy dog again and again"

    def write(name, outputs):
        rows = [{"task": "autoencoding", "ratio": r, "id": i, "output": o, "references": [ref]}
                for (r, i), o in outputs.items()]
        (tmp_path / name).write_text("\n".join(json.dumps(row) for row in rows))
        return str(tmp_path / name)
    before = write("before.jsonl", {(10.0, "a"): "the", (10.0, "b"): "fox", (2.0, "a"): ref})
    after = write("after.jsonl", {(10.0, "a"): ref, (10.0, "b"): "fox", (1.0, "a"): ref})
    monkeypatch.setattr(sys, "argv", ["paired_bleu.py", before, after])
    assert paired.main() == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[2].startswith("| 10 | 2 |")  # r = 2 and r = 1 have no pair
    assert "+50.0 ± 50.0" in lines[2]  # one passage from 0 to 100 sentence BLEU, the other unchanged


def test_reading_plan_cuts_at_the_first_stop_and_reads_the_probes_margin():
    plan = load_script("reading_plan")
    assert plan.cut("Paris.\n\nIt is big.", ["\n\n"]) == "Paris." and plan.cut("Paris.", ["\n"]) == "Paris."
    assert plan.margin({"info": {"relevance": [-3.0, -1.0, -1.5]}}) == pytest.approx(0.5)
    assert plan.margin({"info": {"relevance": [-2.0]}}) == float("inf")


def test_paired_answers_pairs_questions_and_finds_answers_cut_mid_sentence(tmp_path):
    paired = load_script("paired_answers")

    def write(name, system, outputs):
        rows = [{"task": "squad_rag", "system": system, "id": i, "output": o, "references": ["Paris"]}
                for i, o in outputs.items()]
        (tmp_path / f"{name}-predictions.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
        return str(tmp_path / f"{name}-predictions.jsonl")

    long = "It is a city in the north of France and it is"  # 12 words: at the limit, mid-sentence
    before = write("before", "old", {"a": "Paris.", "b": long, "c": "Lyon."})
    after = write("after", "new", {"a": "Paris. Paris is big. Paris is big.", "b": long + " Paris, they say.",
                                   "d": "Nice."})
    systems = paired.load(before) | paired.load(f"{after}:new")
    rows = paired.compare(systems, str.split, limit=12, ngram=3)
    assert [r["system"] for r in rows] == ["old (before)", "new (after)"] and rows[0]["questions"] == 2
    assert (rows[0]["correct"], rows[1]["correct"], rows[1]["paired"]) == (50.0, 100.0, 50.0)
    assert (rows[0]["reached_limit"], rows[0]["cut_mid_sentence"]) == (50.0, 50.0)
    assert (rows[1]["reached_limit"], rows[1]["cut_mid_sentence"]) == (50.0, 0.0)  # finished its sentence
    assert (rows[0]["repeat_ngram"], rows[1]["repeat_ngram"]) == (0.0, 50.0)  # "Paris is big." twice
    assert paired.repeating(systems["new (after)"], str.split, 3) == ["a"]
    with pytest.raises(SystemExit, match="no predictions of system 'gone'"):
        paired.load(f"{after}:gone")


def test_merge_predictions_replaces_the_answers_rerun_and_refuses_strangers():
    merge = load_script("merge_predictions")
    run = [{"task": "squad_rag", "system": "s", "id": i, "output": o} for i, o in (("a", "x x"), ("b", "y"))]
    rerun = [{"task": "squad_rag", "system": "s", "id": "a", "output": "x"}]
    assert [r["output"] for r in merge.merge(run, rerun)] == ["x", "y"]
    with pytest.raises(SystemExit, match="1 answer"):
        merge.merge(run, [{**rerun[0], "system": "other"}])


def test_store_scale_ingest_reports_consistent_counts_bytes_and_rates(make_model, tmp_path):
    """benchmarks/store_scale.py's core at a few passages: the directory store, no Redis, no Ray."""
    scale = load_script("store_scale")
    docs, questions = scale.synthetic_corpus(6)
    assert scale.synthetic_corpus(3) == (docs[:3], questions[:3])  # passage i is the same at any size
    assert len({d.page_content for d in docs}) == 6 and all(q.startswith("Who ") for q in questions)
    model = make_model()
    row = scale.directory_row(docs, scale.NuggetCompressor(model=model), scale.WordHashEmbeddings(),
                              tmp_path / "index", batch_size=4)
    assert row["passages"] == 6 and row["chunks"] >= 6  # characters are tokens here: a passage may make 2 chunks
    assert row["states_written"] == row["store_entries"] == row["chunks"]
    assert row["store_bytes"] == row["state_bytes_written"] > 0 and row["store_disk_bytes"] >= row["store_bytes"]
    assert row["tokens"] >= sum(len(d.page_content) for d in docs)  # every character, and the overlaps
    assert row["store_bytes_per_token"] == round(row["store_bytes"] / row["tokens"], 1)
    assert row["index_file_bytes"] > 0 and row["passages_per_s"] > 0 and row["tokens_per_s"] > 0
    phases = [row[f"{phase}_s"] for phase in ("split", "compress", "embed", "write")]
    assert min(phases) >= 0 and row["split_s"] > 0 and row["compress_s"] > 0 and row["write_s"] > 0
    assert sum(phases) + row["other_s"] == pytest.approx(row["ingest_s"], abs=0.01)
    assert row["split_s_per_passage"] == pytest.approx(row["split_s"] / 6, abs=1e-3)
    assert "compress" not in vars(model)  # the timed methods are the classes' again
    with pytest.raises(ValueError, match="already holds an index"):
        scale.directory_row(docs, scale.NuggetCompressor(model=model), scale.WordHashEmbeddings(),
                            tmp_path / "index", batch_size=4)
    meta = {"passages": 6, "model": "tiny", "embeddings": "word-hash-256", "batch_size": 4, "cpus": 2,
            "machine": "x86_64", "torch_threads": 1, "load_before": 0.1, "load_after": 0.2, "started": "now",
            "requests": 8, "clients": 2, "max_new_tokens": 4}
    queries = {"single process": {"start_s": 1.0, "per_s": 4.0, "errors": 0, "wall": 2.0, "p50": 0.5, "p95": 0.8},
               "Ray, 1 replica": {"start_s": 9.0, "per_s": 2.0, "errors": 0, "wall": 4.0, "p50": 1.0, "p95": 1.6}}
    table = scale.markdown({"meta": meta, "stores": {"directory": row}, "queries": queries})
    assert f"| directory | 6 | {row['tokens']:,} | {row['chunks']:,} |" in table
    assert f"| {row['split_s']:.1f} | {row['split_s_per_passage'] * 1000:.3f} | {row['compress_s']:.1f} |" in table
    assert "| single process | 1.0 | 4.00 | 2.00x | 0 | 2.0 | 0.500 | 0.50x | 0.800 | 0.50x |" in table
    assert "ratios to Ray, 1 replica" in table


def _harness_run(folder: Path, name: str, task: str, split: str, rows: list[tuple[str, float | None, str]],
                 system: str = "nugget", weights: str | None = None) -> None:
    """A harness run's two files: NAME.json (the task's split and source, and the digest of the weights scored: the
    folder's name by default) and NAME-predictions.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    setup = {"weights_sha256": [weights or folder.name, None]}
    (folder / f"{name}.json").write_text(json.dumps({"tasks": {task: {"split": split, "source": "data/squad.json",
                                                                      "setup": setup}}}))
    (folder / f"{name}-predictions.jsonl").write_text("".join(
        json.dumps({"task": task, "system": system, "ratio": ratio, "id": qid, "output": output,
                    "references": ["Paris"]}) + "\n" for qid, ratio, output in rows))


def test_default_decision_ships_a_win_at_r10_that_loses_nothing_and_refuses_test_runs(tmp_path):
    decision = load_script("default_decision")
    questions = [f"q{i}" for i in range(40)]
    _harness_run(tmp_path / "base", "squad-s0", "squad", "dev",
                 [(q, r, "Paris" if i < 10 else "Rome") for i, q in enumerate(questions) for r in (10, 5)])
    # the candidate answers 20 more questions at r = 10 and the same ones at r = 5
    _harness_run(tmp_path / "cand", "squad-s0", "squad", "dev",
                 [(q, 10, "Paris" if i < 30 else "Rome") for i, q in enumerate(questions)]
                 + [(q, 5, "Paris" if i < 10 else "Rome") for i, q in enumerate(questions)])
    result = decision.decide(decision.read_folder(tmp_path / "base"), decision.read_folder(tmp_path / "cand"))
    verdicts = {row["measure"]: row["verdict"] for row in result["rows"]}
    assert verdicts == {"squad r = 10 (nugget, squad.json)": "wins", "squad r = 5 (nugget, squad.json)": "holds"}
    assert result["ships"] and result["weights_sha256"] == {"baseline": "base", "candidate": "cand"}
    assert "Weights scored (sha256, first 16 hex digits): base base, cand cand." in decision.table(result,
                                                                                                    ("base", "cand"))
    # a measure the default was scored on and the candidate was not is no hold: undecided, the default stays
    _harness_run(tmp_path / "base", "ae", "autoencoding", "dev", [(q, 10, "Paris") for q in questions])
    undecided = decision.decide(decision.read_folder(tmp_path / "base"), decision.read_folder(tmp_path / "cand"))
    assert not undecided["ships"] and undecided["missing"] == ["autoencoding r = 10 (nugget, squad.json)"]
    assert "is not decided: the baseline's autoencoding r = 10" in decision.table(undecided, ("base", "cand"))
    # the other way round it does not win, and loses at r = 10: the default stays
    assert not decision.decide(decision.read_folder(tmp_path / "cand"), decision.read_folder(tmp_path / "base"))["ships"]
    _harness_run(tmp_path / "test", "squad-s0", "squad", "test", [("q0", 10, "Paris")])
    with pytest.raises(SystemExit, match="split 'test'.*dev parts only"):
        decision.read_folder(tmp_path / "test")


def test_default_decision_counts_the_reading_plans_run_which_has_no_single_ratio(tmp_path):
    """squad_rag under default_reading records ratio None (each passage is read as text or at its own ratio): it is
    a measure, and a loss there stops the candidate."""
    decision = load_script("default_decision")
    questions = [f"q{i}" for i in range(40)]
    for folder, right_at_10, right_planned in (("base", 10, 30), ("cand", 30, 10)):
        _harness_run(tmp_path / folder, "squad-s0", "squad", "dev",
                     [(q, 10, "Paris" if i < right_at_10 else "Rome") for i, q in enumerate(questions)])
        _harness_run(tmp_path / folder, "squad_rag", "squad_rag", "dev",
                     [(q, None, "Paris" if i < right_planned else "Rome") for i, q in enumerate(questions)],
                     system="default_reading")
    result = decision.decide(decision.read_folder(tmp_path / "base"), decision.read_folder(tmp_path / "cand"))
    verdicts = {row["measure"]: row["verdict"] for row in result["rows"]}
    assert verdicts == {"squad r = 10 (nugget, squad.json)": "wins",
                        "squad_rag as planned (default_reading, squad.json)": "loses"}
    assert not result["ships"]


def test_default_decision_never_pools_runs_of_different_weights(tmp_path):
    decision = load_script("default_decision")
    rows = [(f"q{i}", 10, "Paris") for i in range(4)]
    _harness_run(tmp_path / "cand", "squad-s0", "squad", "dev", rows, weights="1111")
    _harness_run(tmp_path / "cand", "squad-s1", "squad", "dev", rows, weights="2222")
    with pytest.raises(SystemExit, match="holds runs of different weights, which are never pooled: squad-s0.json "
                                         "scored 1111; squad-s1.json scored 2222"):
        decision.read_folder(tmp_path / "cand")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "squad-s0.json").write_text(json.dumps({"tasks": {"squad": {"split": "dev", "source": "s"}}}))
    (tmp_path / "old" / "squad-s0-predictions.jsonl").write_text("")
    with pytest.raises(SystemExit, match="records no digest of the nugget weights it scored"):
        decision.read_folder(tmp_path / "old")


def test_default_decision_scores_the_long_document_summaries_by_rouge_l_paired(tmp_path):
    """benchmarks/long_documents.py --predictions writes the digests' summaries as a harness run with the digest of
    the weights scored; the decision pairs them by digest, scores ROUGE-L, and a loss there stops the candidate."""
    long_documents = load_script("long_documents")
    decision = load_script("default_decision")
    from nugget_rag.eval.long_documents import LongDocument

    reference = "Storms hit Texas on Monday.\nA new law passed in Ohio."
    digests = [LongDocument(id=f"dev-digest-{i}", text="...", reference=reference) for i in range(12)]
    topic = LongDocument(id="topic-compound", text="...", reference=None, terms={"if": "if"})
    for name, good in (("base", 12), ("cand", 0)):  # the candidate's summaries miss the reference
        checkpoint = tmp_path / f"{name}-weights"
        checkpoint.mkdir()
        (checkpoint / "nugget.safetensors").write_bytes(name.encode())
        args = argparse.Namespace(data=Path("data/cnndm-test-250.jsonl"), split="dev", checkpoint=str(checkpoint),
                                  max_new_tokens=160)
        rows = [{"document": d.id, "system": "outline_r4", "summary": reference if i < good else "Nothing at all."}
                for i, d in enumerate(digests)] + [{"document": topic.id, "system": "outline_r4", "summary": "if"}]
        long_documents.write_predictions(tmp_path / name / "summaries", args, [*digests, topic], rows)
    for name in ("base", "cand"):  # every run of the rule beside it, equal on SQuAD but for a win at r = 10
        right = 10 if name == "base" else 30
        _harness_run(tmp_path / name, "squad-s0", "squad", "dev",
                     [(f"q{i}", 10, "Paris" if i < right else "Rome") for i in range(40)],
                     weights=decision.read_folder(tmp_path / name).weights_sha256)
    result = decision.decide(decision.read_folder(tmp_path / "base"), decision.read_folder(tmp_path / "cand"))
    rows = {row["measure"]: row for row in result["rows"]}
    summaries = rows["long_documents r = 4 (outline_r4, cnndm-test-250.jsonl)"]
    assert summaries["items"] == 12 and summaries["baseline"] == pytest.approx(100.0)
    assert summaries["candidate"] == pytest.approx(0.0) and summaries["verdict"] == "loses"
    assert rows["squad r = 10 (nugget, squad.json)"]["verdict"] == "wins" and not result["ships"]
    assert result["weights_sha256"]["baseline"] == decision.read_folder(tmp_path / "base").weights_sha256


def test_ship_default_refuses_float32_another_layout_and_a_decision_that_does_not_ship(tmp_path):
    import torch
    from tiny import tiny_nugget_model

    ship = load_script("ship_default", SCRIPTS)
    model = tiny_nugget_model()
    lineage = {"lineage": [{"updates": 1}]}
    model.save_pretrained(tmp_path / "default", dtype=torch.bfloat16, training=lineage)
    model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16, training=lineage)
    model.save_pretrained(tmp_path / "fp32", dtype=torch.float32, training=lineage)
    model.save_pretrained(tmp_path / "no-lineage", dtype=torch.bfloat16)
    digests = {"baseline": ship.sha256(tmp_path / "default" / "nugget.safetensors")[:16],
               "candidate": ship.sha256(tmp_path / "bf16" / "nugget.safetensors")[:16]}
    wins = {"ships": True, "candidate": "x", "rows": [{"measure": "squad r = 10", "verdict": "wins"}],
            "weights_sha256": digests}
    ship.check(tmp_path / "bf16", wins, tmp_path / "default")  # nothing to refuse
    with pytest.raises(ValueError, match=r"\['F32'\] tensors; the default ships bfloat16: export it with "
                                         "export_dtype: bfloat16"):
        ship.check(tmp_path / "fp32", wins, tmp_path / "default")
    with pytest.raises(ValueError, match="does not ship it"):
        ship.check(tmp_path / "bf16", {**wins, "ships": False}, tmp_path / "default")
    with pytest.raises(ValueError, match="records no lineage"):
        ship.check(tmp_path / "no-lineage", wins, tmp_path / "default")
    config = json.loads((tmp_path / "bf16" / "nugget_config.json").read_text())
    config["config"]["lora"]["rank"] = 8
    (tmp_path / "bf16" / "nugget_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="another layout than the default: lora="):
        ship.check(tmp_path / "bf16", wins, tmp_path / "default")
    config["base_digest"] = "0" * 32
    (tmp_path / "bf16" / "nugget_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trained on base model"):
        ship.check(tmp_path / "bf16", wins, tmp_path / "default")


def test_ship_default_ships_only_the_weights_decided_and_records_the_decision(tmp_path, monkeypatch, capsys):
    import torch
    from tiny import perturb_adapters, tiny_nugget_model

    ship = load_script("ship_default", SCRIPTS)
    lineage = {"lineage": [{"updates": 1}]}
    model = tiny_nugget_model()
    model.save_pretrained(tmp_path / "default", dtype=torch.bfloat16, training=lineage)
    perturb_adapters(model).save_pretrained(tmp_path / "scored", dtype=torch.bfloat16, training=lineage)
    with torch.no_grad():
        next(p for name, p in model.peft.named_parameters() if "lora_B" in name).add_(1.0)
    model.save_pretrained(tmp_path / "other", dtype=torch.bfloat16, training=lineage)
    digests = {"baseline": ship.sha256(tmp_path / "default" / "nugget.safetensors")[:16],
               "candidate": ship.sha256(tmp_path / "scored" / "nugget.safetensors")[:16]}
    decision = {"ships": True, "candidate": "runs/scored", "rows": [{"measure": "squad r = 10", "verdict": "wins"}],
                "weights_sha256": digests}
    with pytest.raises(ValueError, match=rf"other/nugget.safetensors \(sha256 \w{{16}}\) is not the candidate it "
                                         rf"chose: the decision is about weights {digests['candidate']}"):
        ship.check(tmp_path / "other", decision, tmp_path / "default")
    with pytest.raises(ValueError, match="default/nugget.safetensors .* is not the default it was compared with"):
        ship.check(tmp_path / "scored", {**decision, "weights_sha256": {**digests, "baseline": "0" * 16}},
                   tmp_path / "default")
    with pytest.raises(ValueError, match="records no digest of the weights it compared"):
        ship.check(tmp_path / "scored", {**decision, "weights_sha256": None}, tmp_path / "default")
    (tmp_path / "decision.json").write_text(json.dumps(decision))
    monkeypatch.setattr(sys, "argv", ["ship_default.py", str(tmp_path / "other"), "--decision",
                                      str(tmp_path / "decision.json"), "--target", str(tmp_path / "default")])
    with pytest.raises(SystemExit, match="not shipped: .* is not the candidate it chose"):
        ship.main()
    monkeypatch.setattr(sys, "argv", ["ship_default.py", str(tmp_path / "scored"), "--decision",
                                      str(tmp_path / "decision.json"), "--target", str(tmp_path / "default")])
    assert ship.main() == 0
    shipped = json.loads((tmp_path / "default" / "nugget_config.json").read_text())
    assert shipped["decision"] == {"file": "decision.json", "sha256": ship.sha256(tmp_path / "decision.json"),
                                   "weights_sha256": digests}
    assert ship.sha256(tmp_path / "default" / "nugget.safetensors").startswith(digests["candidate"])


def test_the_rule_counts_the_python_docs_passages_its_runs_scored():
    """MODEL_CARD's rule names as many Python-docs dev passages as the decision's runs scored."""
    card = (Path(__file__).parent.parent / "MODEL_CARD.md").read_text()
    rule = card.split("## Choosing the next default", 1)[1].split("- **The rule**", 1)[0]
    decided = json.loads((BENCHMARKS / "results" / "default-decision-answers-50.json").read_text())
    items = {row["items"] for row in decided["rows"] if "python-3.11-docs" in row["measure"]}
    assert items == {22} and "every one of the 22 Python-docs dev passages" in rule


def test_the_shipped_default_is_bfloat16_within_30_mb_with_its_training_record():
    from safetensors import safe_open

    from nugget_rag.model.checkpoint_files import SHIPPED_CHECKPOINT, WEIGHTS_FILE, read_checkpoint_meta

    weights = SHIPPED_CHECKPOINT / WEIGHTS_FILE
    with safe_open(weights, framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    assert weights.stat().st_size <= 30_000_000
    assert read_checkpoint_meta(SHIPPED_CHECKPOINT)["training"]


def test_vector_databases_times_each_store_against_faiss(tmp_path):
    pytest.importorskip("langchain_qdrant", reason="langchain-qdrant is not installed")
    bench = load_script("vector_databases")
    assert bench.main(["--passages", "6", "--questions", "2", "--stores", "faiss", "qdrant", "--max-new-tokens", "2",
                       "--out", str(tmp_path / "vdb")]) == 0
    report = json.loads((tmp_path / "vdb.json").read_text())
    assert [r["store"] for r in report["stores"]] == ["faiss", "qdrant"]
    assert all(r["chunks"] == 6 and r["ingest_s"] > 0 and r["answer_s"] > 0 for r in report["stores"])
    table = (tmp_path / "vdb.md").read_text()
    assert "| faiss | 6 |" in table and "1.00x" in table and "2 answers s" in table


def test_publish_verify_counts_what_redis_sends_a_publish(tmp_path):
    """benchmarks/publish_verify.py at a few passages, on a redis-server of its own."""
    from redis_server import RedisServer  # skips, saying why, where redis-server or the client is missing

    bench = load_script("publish_verify")
    server = RedisServer(tmp_path)
    server.start()
    try:
        run = bench.measure(server.url, passages=12, segment_bytes=4096, publishes=2, seed=0)
        costs = bench.segment_costs(server.url, count=1, mib=1, rounds=1)
    finally:
        server.stop()
    assert run["segments"] >= 3 and run["index_bytes"] > 0
    assert [row["segments_checked"] for row in run["publishes"]] == [run["segments"], run["segments"] + 1]
    # each kept segment is read back
    assert all(row["bytes_sent"] > run["index_bytes"] and row["check_s"] > 0 for row in run["publishes"])
    assert [row["way"] for row in costs] == ["read back, sha256 here", "sha1 in Redis (EVALSHA)"]
    assert costs[0]["bytes_sent"] > 2**20 > costs[1]["bytes_sent"]
    meta = {"machine": "x86_64", "cpus": 2, "started": "now", "load_before": 0.1, "load_after": 0.2}
    table = bench.markdown({"meta": meta, "run": run, "segment_costs": costs})
    assert f"{run['chunks']:,} chunks in {run['segments']} segments" in table and "| median |" in table
    assert "| sha1 in Redis (EVALSHA) | 1 | 1 |" in table


NOT_REPORTS = {"merge_predictions": "writes predictions, not a report", "ttft": "the harness writes its report",
               "reporting": "the writer itself"}


def test_every_benchmark_writes_its_report_through_reporting(tmp_path, capsys):
    """Meta, JSON and Markdown written once (benchmarks/reporting.py), by every script that reports."""
    unwritten = [path.name for path in sorted(BENCHMARKS.glob("*.py"))
                 if path.stem not in NOT_REPORTS and "from reporting import" not in path.read_text()]
    assert not unwritten, f"benchmarks writing their reports by hand: {unwritten}"
    reporting = load_script("reporting")
    lines = reporting.table(["a", "b"], [[1, "x"], [2.5, None]])
    assert lines == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | None |"]
    report = {"meta": reporting.run_meta(command="python benchmarks/x.py", rows=2), "rows": [1, 2]}
    reporting.write_report(tmp_path / "x.md", report, lambda r: f"rows {r['meta']['rows']}, {r['meta']['load_after']}\n")
    written = json.loads((tmp_path / "x.json").read_text())
    assert written["meta"]["command"] == "python benchmarks/x.py" and "load_after" in written["meta"]
    assert (tmp_path / "x.md").read_text() == capsys.readouterr().out.rstrip("\n") + "\n"
    reporting.write_report(None, {"rows": []}, "printed only\n")  # no --out: nothing written
    assert capsys.readouterr().out == "printed only\n\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "x.md"]

"""The `nugget-rag` command, run in-process on the tiny model and hash embeddings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_integrations import HashEmbeddings

from nugget_rag import NuggetCompressor, NuggetLLM, NuggetStore, cli
from nugget_rag.cli import options as cli_options
from nugget_rag.config import ANSWER_NO_REPEAT_NGRAM_SIZE
from nugget_rag.generation.text import first_repeat
from nugget_rag.integrations import NuggetIndex, build_qa_chain


@pytest.fixture(autouse=True)
def tiny_cli(monkeypatch, tiny_model):
    def load_compressor(args, store_dir=None):
        store = NuggetStore(directory=store_dir) if store_dir is not None else NuggetStore()
        return NuggetCompressor(model=tiny_model, store=store, ratio=getattr(args, "ratio", None))

    monkeypatch.setattr(cli.loading, "load_compressor", load_compressor)
    monkeypatch.setattr(cli.loading, "load_embeddings", lambda args: HashEmbeddings())


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "birds.md").write_text("# Falcons\nThe falcon hunts over the river valley and dives at great speed.")
    (folder / "sub" / "bread.txt").write_text("Sourdough bread needs flour, water, salt and a starter culture.")
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00binary")
    jsonl = tmp_path / "planets.jsonl"
    jsonl.write_text(json.dumps({"id": "jupiter", "title": "Jupiter", "text": "Jupiter is the largest planet; its "
                                 "great red spot is a storm."}) + "\n" + json.dumps({"text": "Mars is red and cold."}))
    return folder, jsonl


def ingest(capsys, corpus, index_dir) -> str:
    folder, jsonl = corpus
    assert cli.main(["ingest", str(folder), str(jsonl), "--index", str(index_dir), "--chunk-tokens", "48", "-q"]) == 0
    return capsys.readouterr().out


def test_ingest_folder_and_jsonl(capsys, corpus, tmp_path):
    index_dir = tmp_path / "index"
    out = ingest(capsys, corpus, index_dir)
    assert "Ingested 4 documents" in out and str(index_dir) in out
    files = json.loads((index_dir / "index.json").read_text())["files"]
    docstore = json.loads((index_dir / files["docstore"]["name"]).read_text())
    sources = {d["metadata"]["source"] for d in docstore["documents"]}
    folder, jsonl = corpus
    assert sources == {str(folder / "birds.md"), str(folder / "sub" / "bread.txt"), "jupiter", f"{jsonl}:2"}
    assert all(len(d["page_content"]) <= 48 for d in docstore["documents"])  # char tokenizer: 1 char = 1 token
    manifest = json.loads((index_dir / "index.json").read_text())
    assert manifest["count"] == len(docstore["documents"]) and manifest["chunk_tokens"] == 48
    assert sum(1 for p in (index_dir / "nuggets").rglob("*") if p.is_file()) == manifest["count"]

    again = ingest(capsys, corpus, index_dir)  # appends to the existing index: nothing new
    assert f"(0 new, {manifest['count']} already indexed)" in again
    assert json.loads((index_dir / "index.json").read_text())["count"] == manifest["count"]


def test_ingest_with_text_states_stores_them_and_prints_what_they_cost(capsys, corpus, tmp_path):
    folder, jsonl = corpus
    sizes = {}
    for text_states in (False, True):
        index_dir = tmp_path / f"index-{text_states}"
        flags = ["--text-states"] if text_states else []
        assert cli.main(["ingest", str(folder), str(jsonl), "--index", str(index_dir), "-q", *flags]) == 0
        out = capsys.readouterr().out
        stored = sum(p.stat().st_size for p in (index_dir / "nuggets").rglob("*") if p.is_file())
        assert f"Stored {stored / 2**10:.1f} KiB" in out and "kept down to r = 4" in out
        assert ("with text states" if text_states else "without text states") in out
        sizes[text_states] = stored
    assert sizes[True] > 1.5 * sizes[False]  # a text state beside each chunk's nuggets


def test_refloor_shrinks_an_index_built_at_floor_1_and_refuses_a_finer_one(capsys, corpus, tmp_path):
    folder, jsonl = corpus
    index_dir = tmp_path / "index"
    assert cli.main(["ingest", str(folder), str(jsonl), "--index", str(index_dir), "--keep-ratio", "1", "-q"]) == 0
    assert "kept down to r = 1" in capsys.readouterr().out

    def stored() -> int:
        return sum(p.stat().st_size for p in (index_dir / "nuggets").rglob("*") if p.is_file())

    before = stored()
    assert cli.main(["refloor", "--index", str(index_dir), "--keep-ratio", "4", "-q"]) == 0
    out = capsys.readouterr().out
    chunks = json.loads((index_dir / "index.json").read_text())["count"]
    assert f"Re-floored {chunks} of {chunks} chunks" in out and "from r = 1 to r = 4" in out
    assert json.loads((index_dir / "index.json").read_text())["keep_ratio"] == 4 and stored() < before / 2
    assert cli.main(["refloor", "--index", str(index_dir), "--keep-ratio", "2"]) == 2
    assert "keeps nuggets down to r = 4; a floor of 2 needs" in capsys.readouterr().err


def test_ask_streams_an_answer_and_lists_sources(capsys, corpus, tmp_path, tiny_model):
    index_dir = tmp_path / "index"
    ingest(capsys, corpus, index_dir)
    question = "Which planet has a great red spot storm?"
    assert cli.main(["ask", question, "--index", str(index_dir), "-k", "2", "--max-new-tokens", "5"]) == 0
    answer, sources = capsys.readouterr().out.split("Sources:\n")
    index = NuggetIndex.load(index_dir, NuggetCompressor(model=tiny_model), HashEmbeddings())
    expected = build_qa_chain(index, NuggetLLM(compressor=index.compressor, max_new_tokens=5), k=2).invoke(question)
    assert expected.content and answer == expected.content + "\n"
    lines = sources.strip().splitlines()
    assert len(lines) == 2 and lines[0].strip().startswith("jupiter  title='Jupiter'")


def test_ask_answers_without_loops_by_default_and_can_turn_it_off(capsys, corpus, tmp_path, tiny_model):
    index_dir = tmp_path / "index"
    ingest(capsys, corpus, index_dir)
    index = NuggetIndex.load(index_dir, NuggetCompressor(model=tiny_model), HashEmbeddings())

    def ask(*options: str) -> str:
        assert cli.main(["ask", "Which planet?", "--index", str(index_dir), "--max-new-tokens", "60", *options]) == 0
        return capsys.readouterr().out.split("Sources:\n")[0].removesuffix("\n")

    def chain(**settings) -> str:
        llm = NuggetLLM(compressor=index.compressor, max_new_tokens=60, **settings)
        return build_qa_chain(index, llm).invoke("Which planet?").content

    loops, default = ask("--no-repeat-ngram", "0"), ask()
    assert loops == chain(no_repeat_ngram_size=0)
    assert first_repeat(loops, ANSWER_NO_REPEAT_NGRAM_SIZE) is not None  # the tiny tokenizer: a token a character
    assert default == chain(no_repeat_ngram_size=ANSWER_NO_REPEAT_NGRAM_SIZE) != loops
    penalised = ask("--no-repeat-ngram", "0", "--repetition-penalty", "5")
    assert penalised == chain(no_repeat_ngram_size=0, repetition_penalty=5.0) != loops
    for bad, error in ((["--no-repeat-ngram", "-1"], "must be >= 0 (0: off), got -1"),
                       (["--repetition-penalty", "0.5"], "must be a finite number >= 1 (1: off), got 0.5")):
        assert cli.main(["ask", "Which planet?", "--index", str(index_dir), *bad]) == 2
        assert error in capsys.readouterr().err


def test_ask_with_int8_weights_decodes_in_int8(capsys, corpus, tmp_path, tiny_model):
    index_dir = tmp_path / "index"
    ingest(capsys, corpus, index_dir)
    try:
        assert cli.main(["ask", "Which planet?", "--index", str(index_dir), "--max-new-tokens", "3",
                         "--weights", "int8"]) == 0
        assert tiny_model.merged_format == "int8" and "Sources:" in capsys.readouterr().out
    finally:
        tiny_model.merged_format = "float"
    tiny_model.to(torch.bfloat16)
    try:
        assert cli.main(["ask", "Which planet?", "--index", str(index_dir), "--weights", "int8"]) == 2
        assert "--weights int8: int8 weights are for float32 models on a CPU" in capsys.readouterr().err
    finally:
        tiny_model.to(torch.float32)


@pytest.mark.parametrize(("store", "reason"), [("http://cache:6379", "names the scheme 'http'"),
                                               ("redis://cache:port/0", "does not parse"),
                                               ("cache-dir", "takes a Redis URL")])
def test_a_bad_store_is_refused_by_name_before_the_model_loads(capsys, tmp_path, store, reason):
    assert cli.main(["ingest", str(tmp_path), "--index", str(tmp_path / "index"), "--store", store]) == 2
    err = capsys.readouterr().err
    assert "--store: " in err and repr(store) in err and reason in err and "redis://HOST:PORT/DB" in err


def test_ask_without_index_is_a_user_error(capsys, tmp_path):
    assert cli.main(["ask", "anything?", "--index", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no index in" in err and "nugget-rag ingest" in err and "Traceback" not in err


def test_inspect_writes_html_with_nugget_spans(capsys, tmp_path):
    text = "The falcon dives at great speed over the valley."
    out_file = tmp_path / "view" / "nuggets.html"
    assert cli.main(["inspect", text, "--ratio", "4", "--html", str(out_file)]) == 0
    page = out_file.read_text()
    k = math.ceil(len(text) / 4)
    assert page.count('class="tok nugget"') == k and page.count('class="tok"') == len(text) - k
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page
    assert f"{len(text)} tokens, {k} nuggets" in capsys.readouterr().out


def test_inspect_file_in_the_terminal(capsys, tmp_path):
    path = tmp_path / "note.txt"
    path.write_text("Nuggets are the tokens kept.")
    assert cli.main(["inspect", str(path), "--ratio", "7", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert out.count("[[") == 4 and "28 tokens, 4 nuggets, r = 7.00" in out
    assert out.replace("[[", "").replace("]]", "").startswith("Nuggets are the tokens kept.")


def test_missing_path_is_named_with_exit_code_2(capsys, corpus, tmp_path):
    folder, _ = corpus
    code = cli.main(["ingest", str(folder), str(tmp_path / "nope.txt"), "--index", str(tmp_path / "index")])
    err = capsys.readouterr().err
    assert code == 2 and "nope.txt" in err and "Traceback" not in err
    assert not (tmp_path / "index").exists()
    assert cli.main(["inspect", str(tmp_path / "missing.md")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["inspect", "missing_script.py"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["inspect", str(folder)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_bad_jsonl_and_bad_options(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    assert cli.main(["ingest", str(bad), "--index", str(tmp_path / "index")]) == 2
    assert "bad.jsonl:2 is not valid JSON" in capsys.readouterr().err
    assert cli.main(["inspect", "some text", "--ratio", "0.5"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_checkpoint_flag_names_the_shipped_one_untrained_or_a_directory():
    assert cli_options.checkpoint_arg("default") == "default"
    assert cli_options.checkpoint_arg("none") is None
    assert cli_options.checkpoint_arg("runs/x/final") == Path("runs/x/final")


INGEST_WORKER = """
import sys
sys.path.insert(0, {tests!r})
from test_integrations import HashEmbeddings
from tiny import tiny_base
from nugget_rag import NuggetCompressor, NuggetConfig, NuggetModel, NuggetStore, cli
model = NuggetModel(tiny_base(), NuggetConfig(ratio=4, scorer_layer=2, lora={{"rank": 4}}))
cli.loading.load_compressor = lambda args, store_dir=None: NuggetCompressor(model=model, store=NuggetStore(directory=store_dir))
cli.loading.load_embeddings = lambda args: HashEmbeddings()
sys.exit(cli.main(["ingest", {path!r}, "--index", {index!r}, "--chunk-tokens", "200", "-q"]))
"""


def test_concurrent_ingests_into_one_index_all_land(tmp_path):
    import subprocess
    import sys

    index_dir = tmp_path / "index"
    workers = []
    for worker in range(4):
        path = tmp_path / f"part{worker}.jsonl"
        path.write_text("".join(json.dumps({"id": f"w{worker}-d{i}", "text": f"Note {i} of writer {worker}: "
                                            f"the tide turns {i + worker} times."}) + "\n" for i in range(50)))
        script = INGEST_WORKER.format(tests=str(Path(__file__).parent), path=str(path), index=str(index_dir))
        workers.append(subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
    for process in workers:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
    files = json.loads((index_dir / "index.json").read_text())["files"]
    docstore = json.loads((index_dir / files["docstore"]["name"]).read_text())
    sources = {d["metadata"]["source"] for d in docstore["documents"]}
    assert sources == {f"w{w}-d{i}" for w in range(4) for i in range(50)}


def test_one_command_trains_and_evaluates(capsys):
    for command in ("train", "eval"):
        assert cli.main([command, "--help"]) == 0
        assert f"usage: nugget-rag {command}" in capsys.readouterr().out


def test_serve_takes_its_key_from_the_environment_and_warns_without_one_off_loopback(capsys, monkeypatch, tmp_path):
    pytest.importorskip("fastapi", reason="the server needs the [serve] extra")
    import uvicorn

    from nugget_rag import serving

    given = {}
    create_app = serving.create_app
    monkeypatch.setattr(serving, "create_app", lambda *args, **kwargs: given.update(kwargs) or create_app(*args, **kwargs))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: given.update(kwargs))
    monkeypatch.delenv("NUGGET_RAG_API_KEY", raising=False)
    serve = ["serve", "--index", str(tmp_path / "index"), "--request-timeout", "30"]
    assert cli.main([*serve, "--host", "0.0.0.0"]) == 0
    assert "without an API key" in capsys.readouterr().err
    assert given["api_key"] is None and given["request_timeout_s"] == 30 and given["host"] == "0.0.0.0"
    assert cli.main([*serve, "--host", "127.0.0.1"]) == 0 and "warning" not in capsys.readouterr().err
    monkeypatch.setenv("NUGGET_RAG_API_KEY", "from-the-environment")
    assert cli.main([*serve, "--host", "0.0.0.0"]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err and "API key required" in captured.out
    assert given["api_key"] == "from-the-environment"
    assert cli.main([*serve, "--api-key", "from-the-flag"]) == 0 and given["api_key"] == "from-the-flag"
    assert given["max_ingest_documents"] == 100
    assert cli.main([*serve, "--max-ingest-documents", "7"]) == 0 and given["max_ingest_documents"] == 7

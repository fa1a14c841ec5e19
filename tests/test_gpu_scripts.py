"""The GPU scripts' CPU rehearsals (DRY_RUN=1): every part runs on the tiny model, the OUT layout is the one a GPU call
brings back (at most 8 files), and bad input stops a call before anything trains."""

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from test_benchmarks import SCRIPTS, load_script

ROOT = Path(__file__).parent.parent


def run_script(script: str, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", f"scripts/{script}", str(out), *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=600)


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_the_session_dry_run_trains_scores_and_leaves_what_a_gpu_call_brings_back(tmp_path):
    """The pretraining stage's call; the benchmark dry run below reads the recipe."""
    done = run_script("gpu_session.sh", tmp_path / "out", "300", DRY_RUN="1", CONFIG="configs/pretrain.yaml",
                      EVAL_TASKS="autoencoding", EVAL_RATIOS="2 10", EVAL_LIMIT="2")
    log = (tmp_path / "out" / "train.log").read_text()
    assert done.returncode == 0, done.stderr[-2000:] + log[-3000:]
    files = files_under(tmp_path / "out")
    assert len(files) <= 8
    assert {"export/nugget.safetensors", "export/nugget_config.json", "dev.json", "metrics.jsonl", "loss.png",
            "train.log"} <= set(files)
    assert json.loads((tmp_path / "out" / "export" / "nugget_config.json").read_text())["training"]["steps"] == 1
    scored = json.loads((tmp_path / "out" / "dev.json").read_text())
    assert {row["ratio"] for row in scored["results"] if row["task"] == "autoencoding"} >= {2.0, 10.0}
    assert "dry run" in log and "done in" in log


def test_an_out_that_holds_files_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.json").write_text("{}")
    done = run_script("gpu_session.sh", tmp_path / "out", DRY_RUN="1")
    assert done.returncode == 2 and "already holds files" in done.stderr
    assert files_under(tmp_path / "out") == ["old.json"]


def test_a_damaged_bundle_stops_the_call_before_training(tmp_path):
    bundle = load_script("offline_bundle", SCRIPTS)
    (tmp_path / "src" / "wheels").mkdir(parents=True)
    (tmp_path / "src" / "wheels" / "a.whl").write_bytes(b"x" * 5000)
    bundle.pack(tmp_path / "src", [tmp_path / "src" / "wheels" / "a.whl"], tmp_path / "parts", part_mb=3000 / 2**20)
    piece = next((tmp_path / "parts" / "2").glob("*.001"))
    piece.write_bytes(piece.read_bytes()[:-1])
    done = run_script("gpu_session.sh", tmp_path / "out", DRY_RUN="1", PARTS=str(tmp_path / "parts"))
    log = (tmp_path / "out" / "train.log").read_text()
    assert done.returncode == 3 and "does not join" in log and "SHA-256" in log
    assert "training for" not in log


def test_a_limit_too_short_for_training_is_named(tmp_path):
    done = run_script("gpu_session.sh", tmp_path / "out", "100", DRY_RUN="1")
    assert done.returncode == 2 and "give more SECONDS" in (tmp_path / "out" / "train.log").read_text()


def test_the_benchmark_dry_run_runs_every_part_into_three_files(tmp_path):
    """Every default part finishes within its share, logging its setup seconds apart from its measured ones."""
    done = run_script("gpu_benchmark.sh", tmp_path / "out", DRY_RUN="1")
    log = (tmp_path / "out" / "bench.log").read_text()
    assert done.returncode == 0, done.stderr[-2000:] + log[-3000:]
    assert files_under(tmp_path / "out") == ["bench.log", "bench.md", "reports.tar.gz"]
    bench = (tmp_path / "out" / "bench.md").read_text()
    assert "stopped" not in log and "no time left" not in log and "did not finish" not in bench
    parts = bench.split("\n## ")
    assert [part.splitlines()[0].removeprefix("## ") for part in parts] == [
        "pretrain-step", "speed", "speed-compiled"]
    # the training table, eager and compiled arms: updates/s, tokens/s and MFU, setup and warm-up seconds apart
    assert "| updates/s | tokens/s | model TFLOP/s | MFU |" in parts[0] and "| setup s | warm-up s |" in parts[0]
    assert "| 16 | off | auto |" in parts[0] and "| 16 | step | auto |" in parts[0]
    for part in parts[1:]:  # time to first token and decoding at 1, 4 and 16 documents
        assert re.search(r"Setup: loading the model [\d.]+ s, .* warm-ups .* [\d.]+ s; measured [\d.]+ s", part)
        assert all(f"| {documents} | 10 |" in part for documents in (1, 4, 16))
    arms = re.findall(r"arm .*: setup [\d.]+ s \(loading, tokenising\), warm-up [\d.]+ s .* measured [\d.]+ s", log)
    assert len(arms) == 2  # one line per training arm, and one before its steps (a time limit leaves it in the log)
    assert len(re.findall(r"arm compile=(off|step) .*: set up in [\d.]+ s", log)) == 2
    assert log.count(": done in ") == 3
    with tarfile.open(tmp_path / "out" / "reports.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"pretrain-step.json", "speed.json", "speed-compiled.json"} <= names
    assert not list((ROOT / "benchmarks" / "results").glob("bench-*"))  # the tree keeps only committed reports


def test_a_chain_call_skips_dev_scoring_and_logs_its_setup(tmp_path):
    """EVAL_TASKS=none: the call trains and exports, scores nothing, and logs its setup seconds apart. With the step
    compiled whole (TRAINING.md's chain call; traced with aot_eager here), 8 updates over the chain config's
    objectives and ratios compile one loss graph per objective, whatever the ratio."""
    done = run_script("gpu_session.sh", tmp_path / "out", "300", "--eval-every", "0", "--eval-generate", "0",
                      "--compile", "step", "--compile-backend", "aot_eager", "--max-steps", "8", "--log-every", "8",
                      DRY_RUN="1", CONFIG="configs/pretrain.yaml", EVAL_TASKS="none")
    log = (tmp_path / "out" / "train.log").read_text()
    assert done.returncode == 0, done.stderr[-2000:] + log[-3000:]
    assert "dev.json" not in files_under(tmp_path / "out") and "no dev scoring" in log
    assert "setup before the trainer" in log and '"first_update_s"' in log
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    trained = [line for line in lines if line.get("kind") == "train"][-1]
    assert trained["step"] == 8 and trained["loss_graphs"] == trained["buckets"] <= 2


@pytest.fixture(scope="module")
def ready_sets(tmp_path_factory) -> tuple[Path, Path]:
    """The dry run's pretraining stage and its ready sets (`nugget-rag train --write-ready`)."""
    from dry_run import write

    folder = tmp_path_factory.mktemp("ready")
    stage = write(folder / "dry", ROOT / "configs" / "pretrain.yaml")
    made = subprocess.run([sys.executable, "-m", "nugget_rag.train", "--config", str(stage), "--output-dir",
                           str(folder / "run"), "--write-ready", str(folder / "ready")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    return stage, folder / "ready"


def test_ready_sets_carried_as_one_archive_are_trained_from(ready_sets, tmp_path):
    """READY=<.tar.xz of `--write-ready`'s folder>: the call unpacks it to /tmp/ready and the run loads every source's
    train examples from it."""
    with tarfile.open(tmp_path / "ready.tar.xz", "w:xz") as archive:
        archive.add(ready_sets[1], "ready")
    done = run_script("gpu_session.sh", tmp_path / "out", "300", DRY_RUN="1", CONFIG="configs/pretrain.yaml",
                      EVAL_TASKS="none", READY=str(tmp_path / "ready.tar.xz"))
    log = (tmp_path / "out" / "train.log").read_text()
    assert done.returncode == 0, done.stderr[-2000:] + log[-3000:]
    assert "ready sets from /tmp/ready/ready: autoencoding:python-3.11-docs train, autoencoding:python-3.11-docs#1 " \
           "train, continuation:python-3.11-docs train, continuation:python-3.11-docs#3 train" in log, log[-3000:]


def test_the_training_benchmark_reads_ready_sets_without_tokenising(ready_sets):
    """`training_throughput.py --ready-dir` (the GPU benchmark's READY): the recipe's own sources, loaded ready, no
    tokenizer pass over them; its table is written after the arm."""
    stage, ready = ready_sets
    name = f"test-ready-{os.getpid()}"
    done = subprocess.run([sys.executable, "benchmarks/training_throughput.py", "--config", str(stage), "--ready-dir",
                           str(ready), "--batch-size", "2", "--steps", "2", "--group", "16",
                           "--padding-batches", "1", "--name", name], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    results = [ROOT / "benchmarks" / "results" / f"{name}.{ext}" for ext in ("md", "json")]
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        assert not re.search(r"tokenising \S+:", done.stdout + done.stderr)  # no tokenizer pass (its bar)
        assert json.loads(results[1].read_text())["rows"][0]["updates_per_s"] > 0
    finally:
        for path in results:
            path.unlink(missing_ok=True)

"""Resumable runs: save results after every (task, system, ratio) cell and reuse the cells of an earlier run.

A cell is reused only when its task's *setup* is the same: data file, split, limit, the examples' ids, the
checkpoints (paths and weights digests), base model (name and weights digest), device type, dtype, batch size and
the task's generation settings. Speed and the optimal-selection study are carried over as they are. A run of other
tasks, systems or ratios under the same name adds its cells to the same report (`commands` lists every
contributing run).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from ..config import PROBE_RATIO
from ..model.checkpoint_files import DEFAULT_CHECKPOINT, WEIGHTS_FILE, default_checkpoint_for
from ..prompts import QA_PROMPT
from ..state.files import write_atomic
from .config import EvalConfig
from .tasks import TaskData

log = logging.getLogger(__name__)


def checkpoint_name(cfg: EvalConfig) -> str | None:
    """The nugget checkpoint as recorded in results: a path, or None for untrained adapters."""
    if cfg.checkpoint == DEFAULT_CHECKPOINT:
        shipped = default_checkpoint_for(cfg.base_model)
        return f"{DEFAULT_CHECKPOINT} ({shipped.name})" if shipped is not None else None
    return str(cfg.checkpoint) if cfg.checkpoint is not None else None


def weights_sha256(checkpoint: Path | str | None, base_model: str | None = None) -> str | None:
    """Digest of a checkpoint's weights file ('default': the shipped one), so that retraining into the same
    directory is not taken for the same checkpoint; None for untrained adapters."""
    if checkpoint == DEFAULT_CHECKPOINT:
        checkpoint = default_checkpoint_for(base_model)
    if checkpoint is None:
        return None
    return hashlib.sha256((Path(checkpoint) / WEIGHTS_FILE).read_bytes()).hexdigest()[:16]


def task_setup(cfg: EvalConfig, task: TaskData, model) -> dict:
    """Everything a task's scores depend on besides the system and the ratio."""
    ids = hashlib.sha256("\n".join(e.id for e in task.examples).encode()).hexdigest()[:16]
    setup = {
        "source": str(task.source), "split": task.split, "limit": cfg.limit_for(task.name),
        "examples": len(task.examples), "example_ids_sha256": ids,
        "checkpoint": checkpoint_name(cfg),
        "full_checkpoint": str(cfg.full_checkpoint) if cfg.full_checkpoint else None,
        "weights_sha256": [weights_sha256(cfg.checkpoint, cfg.base_model), weights_sha256(cfg.full_checkpoint)],
        "base_digest": model.base_digest,
        "base_model": model.base_name, "device": model.device.type, "dtype": str(model.dtype).replace("torch.", ""),
        "batch_size": cfg.batch_size, "placement": model.config.placement,
    }
    if model.merged_format != "float":
        setup["weights"] = model.merged_format
    if task.kind == "qa":
        setup["max_new_tokens"] = cfg.qa_max_new_tokens
        if cfg.qa_prompt != QA_PROMPT:
            setup["qa_prompt"] = cfg.qa_prompt
        if cfg.keep_ratio != PROBE_RATIO:
            setup["keep_ratio"] = cfg.keep_ratio
        if cfg.qa_finish_sentence:
            setup["finish_sentence"] = cfg.qa_finish_sentence
        if cfg.qa_no_repeat_ngram_size:
            setup["no_repeat_ngram_size"] = cfg.qa_no_repeat_ngram_size
        if cfg.qa_repetition_penalty != 1.0:
            setup["repetition_penalty"] = cfg.qa_repetition_penalty
    elif task.kind == "summarization":
        setup["max_new_tokens"] = cfg.summary_max_new_tokens
        if task.name == "long_cnndm":
            setup["long_articles"] = cfg.long_articles
    elif task.kind == "autoencoding":
        setup.update(ae_lengths=list(cfg.ae_lengths), ae_max_new_tokens=cfg.ae_max_new_tokens)
    elif task.kind == "lm":
        setup["lm"] = cfg.lm.model_dump()
    return setup


def paths(cfg: EvalConfig) -> tuple[Path, Path]:
    out = Path(cfg.out_dir)
    return out / f"{cfg.name}.json", out / f"{cfg.name}-predictions.jsonl"


def load_previous(cfg: EvalConfig) -> tuple[dict | None, list[dict]]:
    """The earlier run's results and predictions (None when there is none)."""
    results_path, predictions_path = paths(cfg)
    if not results_path.exists():
        log.info("--resume: no earlier results at %s; starting afresh", results_path)
        return None, []
    previous = json.loads(results_path.read_text())
    predictions = []
    if predictions_path.exists():
        predictions = [json.loads(line) for line in predictions_path.read_text().splitlines() if line.strip()]
    return previous, predictions


def merge_previous(results: dict, previous: dict, predictions: list[dict]) -> None:
    """Carry the earlier run's tasks, systems, cells, speed and commands into `results` (in place).

    For a task of this run whose setup differs from the earlier one, the earlier cells are dropped (logged).
    """
    running = set(results["tasks"])  # their n/a and unavailable rows are produced again by this run
    dropped = set()
    for name, info in previous.get("tasks", {}).items():
        current = results["tasks"].get(name)
        if current is None:
            results["tasks"][name] = info
        elif info.get("setup") != current["setup"]:
            dropped.add(name)
            log.warning("--resume: task %s was run with another setup; its earlier cells are recomputed "
                        "(earlier %s, now %s)", name, info.get("setup"), current["setup"])
    for name, info in previous.get("systems", {}).items():
        results["systems"].setdefault(name, info)
    results["results"] = [r for r in previous.get("results", []) if r["task"] not in dropped
                          and (r["status"] == "ok" or r["task"] not in running)]
    results["predictions"] = [p for p in predictions if p["task"] not in dropped]
    commands = previous["meta"].get("commands") or [previous["meta"].get("command", "")]
    results["meta"]["commands"] = [c for c in commands if c] + results["meta"]["commands"]
    for key in ("speed", "optimal"):
        if key in previous:
            results[key] = previous[key]


def done(results: dict, task: str, system: str, ratio: float | None) -> bool:
    return any(r["task"] == task and r["system"] == system and r["ratio"] == ratio and r["status"] == "ok"
               for r in results["results"])


def save_progress(results: dict, cfg: EvalConfig) -> None:
    """Write the results so far (JSON and predictions), atomically, so that a stopped run can be resumed."""
    if cfg.out_dir is None:
        return
    results_path, predictions_path = paths(cfg)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    body = {k: v for k, v in results.items() if k != "predictions"}
    write_atomic(results_path, json.dumps(body, indent=2, default=str))
    write_atomic(predictions_path, "".join(json.dumps(p) + "\n" for p in results["predictions"]))

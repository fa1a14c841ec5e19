"""Runs every (task, system, ratio) of an EvalConfig on one model and writes JSON, markdown and plots."""

from __future__ import annotations

import logging
import platform
import time
from collections import Counter
from collections.abc import Iterator
from datetime import date
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from ..generation.decoding import GenerationSettings, generate
from ..model.nugget_model import NuggetModel
from .config import TASKS, EvalConfig
from .resume import checkpoint_name, done, load_previous, merge_previous, save_progress, task_setup
from .systems import SYSTEMS, Env, Reading, Skipped, System, get_system
from .systems.base import kept_slots, prompt_ids
from .systems.peers import close_peers
from .tasks import TaskData, load_task, score

log = logging.getLogger(__name__)
PREPARE_CHUNK = 16


def machine_description(model: NuggetModel) -> str:
    device = model.device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    weights = "" if model.merged_format == "float" else f", {model.merged_format} decoder"
    decoding = "" if model.decoding == "dynamic" else f", {model.decoding} decoding"
    return f"{where}; torch {torch.__version__}; {model.dtype}{weights}{decoding}".replace("torch.", "")


def load_models(cfg: EvalConfig) -> tuple[NuggetModel, NuggetModel | None, str | None]:
    from ..model.base_model import convert_default_model

    model = NuggetModel.from_pretrained(cfg.checkpoint, base_model=cfg.base_model, device=cfg.device, dtype=cfg.dtype)
    model.merged_format = cfg.weights
    model.decoding = cfg.decoding
    full = None
    if cfg.full_checkpoint is not None:
        full = NuggetModel.from_pretrained(cfg.full_checkpoint, base_model=cfg.base_model, device=cfg.device,
                                           dtype=cfg.dtype)
    base_path = str(cfg.base_model) if cfg.base_model is not None else str(convert_default_model())
    return model, full, base_path


def run(cfg: EvalConfig, model: NuggetModel | None = None, full_model: NuggetModel | None = None,
        base_model_path: str | None = None, peer_python: str | None = None) -> dict:
    """Evaluate; returns the results dict (also written to cfg.out_dir unless out_dir is None)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    load_s = None
    if model is None:
        start = time.perf_counter()
        model, full_model, base_model_path = load_models(cfg)
        load_s = round(time.perf_counter() - start, 2)
    env = Env(model=model, full_model=full_model, base_model_path=base_model_path, peer_python=peer_python,
              batch_size=cfg.batch_size, keep_ratio=cfg.keep_ratio, threads=cfg.threads, show_progress=cfg.progress)
    quality_tasks = [t for t in cfg.tasks if t != "speed"]
    data = {name: load_task(name, cfg, model) for name in quality_tasks}  # all data first: fail before computing
    systems = [get_system(name) for name in cfg.systems]
    results: dict = {
        "meta": {
            "date": date.today().isoformat(), "machine": machine_description(model), "model": model.base_name,
            "checkpoint": checkpoint_name(cfg),
            "full_checkpoint": str(cfg.full_checkpoint) if cfg.full_checkpoint else None,
            "adapters": "trained" if checkpoint_name(cfg) else "untrained",
            "command": cfg.command, "commands": [cfg.command] if cfg.command else [],
            "config": cfg.model_dump(mode="json"),
        },
        "systems": {s.name: {"label": s.label, "description": s.description, "reimplementation": s.reimplementation,
                             "reference": s.reference, "uses_ratio": s.uses_ratio, "kinds": sorted(s.kinds),
                             "unavailable": s.available(env)} for s in systems},
        "tasks": {name: {"kind": d.kind, "source": d.source, "split": d.split, "examples": len(d.examples),
                         "examined": d.examined, "skipped": dict(d.skipped), "metric": d.metric,
                         "setup": task_setup(cfg, d, model)}
                  for name, d in data.items()},
        "results": [],
        "predictions": [],
    }
    if cfg.resume:
        previous, predictions = load_previous(cfg)
        if previous is not None:
            merge_previous(results, previous, predictions)
    try:
        with torch.inference_mode():
            for task in data.values():
                for system in systems:
                    for row in evaluate_system(env, system, task, cfg, results["predictions"], skip=results):
                        results["results"] = [r for r in results["results"] if _key(r) != _key(row)] + [row]
                        save_progress(results, cfg)
            if "speed" in cfg.tasks:
                from .speed import run_speed

                speed = run_speed(env, cfg)
                speed["setup_s"] = {"model": load_s, **speed["setup_s"]}
                results["speed"] = {**speed, "date": results["meta"]["date"], "machine": results["meta"]["machine"],
                                    "command": cfg.command}
        if cfg.optimal:
            from .optimal import run_optimal

            results["optimal"] = run_optimal(env, cfg)
    finally:
        close_peers(env)
        for s in systems:
            s.close()
    results["tasks"] = dict(sorted(results["tasks"].items(), key=lambda kv: TASKS.index(kv[0])))
    order = list(SYSTEMS)
    results["systems"] = dict(sorted(results["systems"].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    if cfg.out_dir is not None:
        from .report import write_outputs

        results["files"] = write_outputs(results, cfg)
    return results


def _key(row: dict) -> tuple:
    return row["task"], row["system"], row["ratio"]


def evaluate_system(env: Env, system: System, task: TaskData, cfg: EvalConfig, predictions: list,
                    skip: dict | None = None) -> Iterator[dict]:
    """One row per ratio (one for ratio-free systems); cells already done in `skip`'s results are not rerun."""
    base = {"task": task.name, "system": system.name, "label": system.label}
    if task.kind not in system.kinds:
        yield {**base, "ratio": None, "status": "n/a", "reason": f"{system.name} does not support {task.kind}"}
        return
    reason = system.available(env)
    if reason is not None:
        yield {**base, "ratio": None, "status": "unavailable", "reason": reason}
        return
    for ratio in (cfg.ratios if system.uses_ratio else [None]):
        if skip is not None and done(skip, task.name, system.name, ratio):
            log.info("%s %s r=%s: kept from the earlier run", task.name, system.name, ratio)
            continue
        start = time.perf_counter()
        row = {**base, "ratio": ratio, "status": "ok"}
        row.update(evaluate(env, system, task, ratio, cfg, predictions))
        row["seconds"] = round(time.perf_counter() - start, 2)
        log.info("%s %s r=%s: %s", task.name, system.name, ratio, row.get("metrics"))
        yield row


def evaluate(env: Env, system: System, task: TaskData, ratio: float | None, cfg: EvalConfig, predictions: list) -> dict:
    model = env.model
    tok = model.tokenizer
    examples = task.examples
    readings: list[Reading | Skipped] = []
    desc = f"{task.name} {system.name}" + (f" r={ratio:g}" if ratio else "")
    bar = tqdm(total=len(examples), desc=desc, unit="ex", disable=not cfg.progress, leave=False)
    for start in range(0, len(examples), PREPARE_CHUNK):
        part = examples[start : start + PREPARE_CHUNK]
        got = system.prepare(env, [e.query for e in part], ratio)
        if len(got) != len(part):
            raise RuntimeError(f"{system.name}.prepare returned {len(got)} readings for {len(part)} queries")
        readings.extend(got)
        bar.update(len(part) / 2)
    skipped: Counter = Counter()
    work: list[_Work] = []
    for i, (ex, reading) in enumerate(zip(examples, readings)):
        if isinstance(reading, Skipped):
            skipped[reading.reason] += 1
            continue
        prefix, prompt = prompt_ids(reading.model or model, ex.query, reading) if reading.answer is None else ([], [])
        slots = len(prefix) + (sum(s.k for s in reading.states) if reading.states is not None else 0)
        extra = 0 if ex.query.kind == "lm" else ex.query.max_new_tokens
        soft = model.soft_prompt.shape[0] if reading.soft_prompt else 0
        if reading.answer is None and slots + soft + len(prompt) + extra > model.max_positions:
            skipped["exceeds the model's positions"] += 1
            continue
        if reading.answer is None and not prompt and not reading.soft_prompt:
            skipped["empty prompt"] += 1
            continue
        work.append(_Work(i, reading, prefix, prompt))
    outputs: dict[int, object] = {}
    if task.kind == "lm":
        for w in work:
            outputs[w.index] = _target_nll(w.reading.model or model, w.reading, w.prefix, w.prompt,
                                           len(examples[w.index].query.target_ids))
            bar.update(0.5)
    else:
        groups: dict[tuple, list[_Work]] = {}
        for w in work:
            if w.reading.answer is not None:
                outputs[w.index] = w.reading.answer
                continue
            key = (id(w.reading.model or model), w.reading.adapter, w.reading.soft_prompt,
                   examples[w.index].query.max_new_tokens)
            groups.setdefault(key, []).append(w)
        settings = GenerationSettings(max_new_tokens=1, temperature=0,
                                      **(cfg.qa_generation() if task.kind == "qa" else {}))
        for (_, adapter, soft, max_new), items in groups.items():
            items.sort(key=lambda w: len(w.prefix) + len(w.prompt) + sum(s.k for s in w.reading.states or []))
            for start in range(0, len(items), cfg.batch_size):
                batch = items[start : start + cfg.batch_size]
                texts = generate(batch[0].reading.model or model, [w.reading.states or [] for w in batch],
                                 [w.prompt for w in batch], settings.model_copy(update={"max_new_tokens": max_new}),
                                 soft_prompt=soft, adapter=adapter, prefixes=[w.prefix for w in batch])
                for w, text in zip(batch, texts):
                    outputs[w.index] = text
                bar.update(len(batch) / 2)
        bar.update(len(examples) - bar.n)
    bar.close()
    done = sorted(outputs)
    scored = [examples[i] for i in done]
    values = [outputs[i] for i in done]
    empty = 0 if task.kind == "lm" else sum(1 for v in values if not str(v).strip())
    doc_tokens = sum(sum(map(len, examples[i].query.document_ids)) for i in done)
    kept = [kept_slots(tok, readings[i]) for i in done]
    notes: Counter = Counter()
    for i in done:
        for key, value in readings[i].info.items():
            if key != "kept_tokens" and isinstance(value, int):  # counts, such as gold_read_whole
                notes[key] += value
    for i in done:
        info = {k: v for k, v in readings[i].info.items() if k != "kept_tokens" and isinstance(v, (int, float, list))}
        predictions.append({"task": task.name, "system": system.name, "ratio": ratio, "id": examples[i].id,
                            "output": outputs[i] if task.kind != "lm" else {"nll": outputs[i][0], "tokens": outputs[i][1]},
                            "references": examples[i].references, **({"info": info} if info else {})})
    row = {
        "metrics": score(task, scored, values),
        "examples": len(examples), "scored": len(done), "skipped": dict(skipped), "empty_outputs": empty,
        "doc_tokens": doc_tokens,
    }
    if kept and all(k is not None for k in kept):
        row["kept_slots"] = float(sum(kept))
        row["achieved_ratio"] = doc_tokens / sum(kept) if sum(kept) else None
    if notes:
        row["notes"] = dict(notes)
    return row


class _Work(NamedTuple):
    """An example the decoder will read: its index, the system's reading, and the prompt around any states."""

    index: int
    reading: Reading
    prefix: list[int]
    prompt: list[int]


def _target_nll(model: NuggetModel, reading: Reading, prefix: list[int], prompt: list[int],
                targets: int) -> tuple[float, int]:
    """Sum of the target tokens' negative log-likelihoods (the last `targets` ids of the prompt) and their count."""
    ids = torch.tensor([prompt], device=model.device)
    labels = torch.full_like(ids, -100)
    labels[0, -targets:] = ids[0, -targets:]
    out = model.decode([reading.states or []], ids, labels=labels, soft_prompt=reading.soft_prompt,
                       adapter=reading.adapter, return_logits=False, prefixes=[prefix])
    return float(out.loss) * targets, targets


def registered() -> list[str]:
    return sorted(SYSTEMS)

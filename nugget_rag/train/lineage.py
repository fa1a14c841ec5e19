"""The lineage of an export: one segment per training run (a bounded GPU call), with cumulative totals, so that a
stage trained as a chain of calls (each from the previous call's export) keeps counting its updates, examples and
tokens, and knows the stage it trains.

A chain is the trailing run of segments that began with one trained with `chain: false` (an export from before
lineages counts as one such segment, of its `steps`). A run with `chain: true` continues its learning-rate schedule
from the chain's updates and must train the chain's stage (`stage_of`).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import torch

from ..config import LEGACY_PLACEMENT, NuggetConfig
from ..state.files import sha256_file
from .config import TrainConfig

TOTALS = ("updates", "examples", "tokens")
NOT_STAGE = {"ratio", "seed"}  # nugget settings a chain may change: the ratio is a recipe setting, like `ratios`


def stage_of(config: TrainConfig) -> dict:
    """What a chain must keep: the objectives (names only), the example lengths and the nugget settings."""
    return {"objectives": sorted({"full_context" if s.full_context else s.objective for s in config.data}),
            "lengths": config.lengths.model_dump(mode="json"),
            "nugget": _nugget(config.nugget)}


def _nugget(nugget: NuggetConfig) -> dict:
    return nugget.model_dump(mode="json", exclude=NOT_STAGE)


def earlier(meta: dict) -> list[dict]:
    """The lineage recorded in a checkpoint's metadata (read_checkpoint_meta); an export without one (trained before
    lineages) as one segment of its `steps`, what else it trained with unknown (null); no training record: none."""
    record = meta.get("training")
    if not record:
        return []
    if "lineage" in record:
        return record["lineage"]
    objectives = sorted({name.split(":")[0] for name in record.get("objectives", [])})
    nugget = NuggetConfig.model_validate({"placement": LEGACY_PLACEMENT, **meta["config"]})
    return [{"updates": record.get("steps"), "examples": None, "tokens": None, "chain": False,
             "stage": {"objectives": objectives, "lengths": None, "nugget": _nugget(nugget)},
             "settings": {"ratios": record.get("ratios"), "distill": (record.get("distill") or {}).get("weight")},
             "sources": None, "date": None, "device": None}]


def chain_updates(lineage: list[dict]) -> int:
    """Updates of the chain the lineage ends in: those of its segments since the last one that began a chain."""
    total = 0
    for segment in reversed(lineage):
        total += segment["updates"] or 0
        if not segment["chain"]:
            break
    return total


def check_stage(lineage: list[dict], stage: dict, init_from: str | Path) -> None:
    """Refuse to chain onto an export of another stage (a setting unknown to an older export is not compared)."""
    if not lineage:
        return
    before = lineage[-1]["stage"]
    differ = [k for k in stage if before.get(k) is not None and before[k] != stage[k]]
    if differ:
        def show(s: dict) -> str:
            return "; ".join(f"{k}={s[k]}" for k in differ)

        raise ValueError(f"chain: the lineage of init_from {init_from} is stage {show(before)}; the config trains "
                         f"{show(stage)}; start a new chain with init_from and chain: false, or use a config of the "
                         "same stage")


def sources(config: TrainConfig) -> list[dict]:
    """Each data source: objective, file name, weight and a short sha256 of the file (a folder or hub data set: its
    name alone)."""
    shas: dict[str, str | None] = {}
    out = []
    for s in config.data:
        path = Path(s.path)
        if s.path not in shas:
            shas[s.path] = sha256_file(path)[:12] if path.is_file() else None
        out.append({"objective": "full_context" if s.full_context else s.objective, "file": path.name,
                    "sha": shas[s.path], "weight": s.weight})
    return out



def segment(config: TrainConfig, updates: int, processes: int, tokens: int | None, device: torch.device,
            data: list[dict]) -> dict:
    """This run's entry: its updates, examples and tokens read, data, key settings, date and device."""
    cfg, optim = config, config.optim
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"updates": updates, "examples": updates * cfg.batch_size * cfg.grad_accum * processes, "tokens": tokens,
            "chain": cfg.chain, "stage": stage_of(cfg),
            "settings": {"lr": optim.lr, "scorer_lr": optim.scorer_lr, "soft_prompt_lr": optim.soft_prompt_lr,
                         "encoder_lr": optim.encoder_lr, "warmup_steps": optim.warmup_steps,
                         "schedule": optim.schedule, "max_steps": cfg.max_steps, "batch_size": cfg.batch_size,
                         "grad_accum": cfg.grad_accum, "ratios": list(cfg.ratio_range()),
                         "distill": cfg.distill.weight},
            "sources": data, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "device": name if processes == 1 else f"{processes} x {name}"}


def record(lineage: list[dict]) -> dict:
    """The lineage and its totals (a total is null where a segment's is unknown), and the updates of its chain."""
    totals = {k: None if any(s[k] is None for s in lineage) else sum(s[k] for s in lineage) for k in TOTALS}
    return {"lineage": lineage, **totals, "chain_updates": chain_updates(lineage)}

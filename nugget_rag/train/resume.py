"""Resume and export: a run's settings held to those of its folder's checkpoints, where it starts (`init_from` and
the lineage it continues), its checkpoints saved and restored, and the final export with its training record."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from pydantic import TypeAdapter

from ..config import NuggetConfig
from ..model.checkpoint_files import DEFAULT_CHECKPOINT, checkpoint_config, default_checkpoint_for, read_checkpoint_meta
from ..model.nugget_model import NuggetModel
from . import checkpoint, lineage
from .batches import Mixture
from .compiled_step import tensor_learning_rates
from .config import TrainConfig

log = logging.getLogger(__package__ + ".trainer")  # a run's lines in train.log keep the trainer's name

CONFIG_FILE = "train_config.json"
RECIPE = {"distill", "ratios", "scorer_warm_start"}  # settings a resumed run may change (with a warning)
FINAL_DIR = "final"


def check_resume(config: TrainConfig, out: Path) -> None:
    """A resumed run must keep the settings that shape its data and model; a changed recipe (distillation,
    ratios, warm start) is allowed, with a warning that names it."""
    saved = out / CONFIG_FILE
    if checkpoint.latest(out) is not None and saved.is_file():
        now = config.resume_key()
        defaults = _defaults(config, set(now))
        before = defaults | {k: defaults[k] | v if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
                             for k, v in json.loads(saved.read_text()).items()}
        differ = sorted(k for k in now if before.get(k) != now[k])
        changed = [k for k in differ if k in RECIPE]
        if changed:
            log.warning("resuming %s with another recipe: %s (was %s)", out,
                        ", ".join(f"{k}={json.dumps(now.get(k))}" for k in changed),
                        ", ".join(f"{k}={json.dumps(before.get(k))}" for k in changed))
        differ = [k for k in differ if k not in RECIPE]
        if differ:
            raise ValueError(
                f"{out} holds checkpoints of a run with other settings ({', '.join(differ)} differ); "
                "resume with the same settings, or choose another output_dir"
            )


def _defaults(config: TrainConfig, names: set[str]) -> dict:
    """The defaults of these settings: a setting added after a run began counts as its default there (a nested
    one too, such as optim.encoder_lr)."""
    fields = type(config).model_fields
    return {k: TypeAdapter(fields[k].annotation).dump_python(fields[k].get_default(call_default_factory=True),
                                                             mode="json") for k in names if not fields[k].is_required()}


def start_from(config: TrainConfig, model: NuggetModel, out: Path) -> list[dict]:
    """Load `init_from`'s parts into the model (its adapters checked against the config's, a chain's stage against
    its lineage's); returns the lineage this run continues (a resumed run's own, as its checkpoint holds it)."""
    earlier: list[dict] = []
    if config.init_from:
        start = _init_checkpoint(config.init_from, model)
        trained_with = checkpoint_config(start)
        if trained_with.placement != model.config.placement:
            log.warning("init_from %s was trained with placement=%s; this run trains placement=%s (set "
                        "nugget.placement to keep the checkpoint's)", start, trained_with.placement,
                        model.config.placement)
        _check_lora(start, trained_with, model.config)
        earlier = lineage.earlier(read_checkpoint_meta(start))
        if config.chain:
            lineage.check_stage(earlier, lineage.stage_of(config), start)
        model.load_parts(start)
    found, _ = start_point(config, out)
    if found is not None:  # a resumed run (or a branch) continues the lineage its checkpoint holds
        earlier = checkpoint.read_state(found).get("lineage", earlier)
    return earlier


def start_point(config: TrainConfig, out: Path) -> tuple[Path | None, bool]:
    """The checkpoint a run starts at, and whether it is a branch's: `out`'s latest, else `branch_from` (a folder
    that is not a run's checkpoint is refused), else none."""
    found = checkpoint.latest(out)
    if found is not None or config.branch_from is None:
        return found, False
    found = Path(config.branch_from)
    if not (found / checkpoint.STATE_FILE).is_file():
        raise ValueError(f"branch_from {found} is not a run's checkpoint (it has no {checkpoint.STATE_FILE}); "
                         "pass a checkpoint-N folder of a run's output_dir")
    return found, True


def _init_checkpoint(init_from: str, model: NuggetModel) -> str | Path:
    """`init_from` as a directory; 'default' is the checkpoint shipped for the model's base (if any)."""
    if init_from != DEFAULT_CHECKPOINT:
        return init_from
    shipped = default_checkpoint_for(model.base_name)
    if shipped is None:
        raise ValueError(f"init_from='default' names the checkpoint shipped for SmolLM2-135M-Instruct; the base model "
                         f"{model.base_name!r} has none: pass a checkpoint directory, or leave init_from unset")
    return shipped


def _check_lora(start: str | Path, trained: NuggetConfig, config: NuggetConfig) -> None:
    """Refuse an init_from checkpoint whose adapters have another shape than the config's."""
    differ = [f"lora.{k}={getattr(trained.lora, k)} (the config: {getattr(config.lora, k)})"
              for k in ("rank", "target_modules") if getattr(trained.lora, k) != getattr(config.lora, k)]
    if differ:
        raise ValueError(f"init_from {start} has adapters of another shape: {', '.join(differ)}; set nugget.lora to "
                         "the checkpoint's, or start without init_from")


def restore(found: Path, model: NuggetModel, optimizer: torch.optim.Optimizer, scheduler, mixture: Mixture,
            accelerator: Accelerator, compiled: bool, max_steps: int, data: bool = True) -> dict:
    """Restore the checkpoint `found`: the model's parts, optimiser, schedule, data position (unless `data` is false:
    a branch draws its own) and gradient scaler; returns its trainer state."""
    model.load_parts(found)
    meta = checkpoint.load(found, optimizer, scheduler)
    if compiled:
        tensor_learning_rates(optimizer)
    if data:
        mixture.load_state_dict(meta["data"])
    if meta.get("scaler") and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(meta["scaler"])
    if meta.get("max_steps", max_steps) != max_steps:
        log.warning("resuming a run of max_steps=%d with max_steps=%d: the learning-rate schedule now spans the "
                    "new number of steps, so the rate changes from here on", meta["max_steps"], max_steps)
    return meta


def save(config: TrainConfig, out: Path, step: int, model: NuggetModel, optimizer: torch.optim.Optimizer, scheduler,
         mixture: Mixture, accelerator: Accelerator, tokens: int | None, earlier: list[dict]) -> None:
    """Write the checkpoint of `step` (the main process): what `restore` reads, and the lineage."""
    scaler = accelerator.scaler
    state = {"data": mixture.state_dict(), "max_steps": config.max_steps, "tokens": tokens, "lineage": earlier,
             "scaler": scaler.state_dict() if scaler is not None else None}
    checkpoint.save(out, step, model, optimizer, scheduler, state, config.keep_last)


def training_record(config: TrainConfig, step: int, names: list[str], earlier: list[dict], tokens: int | None,
                    accelerator: Accelerator) -> dict:
    """How the exported parts were trained (written beside them): this run's settings, and the lineage with this
    run (which read `tokens`) as its last segment."""
    run = lineage.segment(config, step, accelerator.num_processes, tokens, accelerator.device, lineage.sources(config))
    return {"steps": step, "ratios": list(config.ratio_range()), "objectives": names,
            "distill": config.distill.model_dump(mode="json") if config.distill.weight > 0 else None,
            "scorer_warm_start": config.scorer_warm_start.model_dump(mode="json"),
            **lineage.record([*earlier, run])}


def export(out: Path, model: NuggetModel, dtype: str, record: dict, name: str = FINAL_DIR) -> Path:
    """Save the trained parts in `dtype` with their training record as `out`/`name`, replacing an older export."""
    final, staging = out / name, out / f".tmp-{name}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, dtype=getattr(torch, dtype), training=record)
    checkpoint.publish(staging, final)
    return final

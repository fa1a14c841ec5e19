"""Training checkpoints in safe formats only (safetensors + JSON), written atomically, the last N kept.

A checkpoint directory holds the nugget parts (`NuggetModel.save_pretrained`), the optimiser's tensors
(`optimizer.safetensors`), the RNG tensors (`rng.safetensors`) and `trainer_state.json` (step, optimiser
hyper-parameters, scheduler, data position, Python/NumPy RNG, the run's config). It is written into a temporary
directory and renamed into place, so a kill mid-write leaves the previous checkpoint as the latest good one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..state.files import fsync_directory

log = logging.getLogger(__name__)

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"


def checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    found = [p for p in Path(output_dir).glob(f"{PREFIX}*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(output_dir: Path) -> Path | None:
    found = checkpoints(output_dir)
    return found[-1] if found else None


def save(output_dir: Path, step: int, model, optimizer: torch.optim.Optimizer, scheduler, state: dict,
         keep_last: int) -> Path:
    """Write checkpoint-<step> (atomically) and delete all but the newest `keep_last`."""
    output_dir = Path(output_dir)
    final = output_dir / f"{PREFIX}{step}"
    tmp = output_dir / f".tmp-{PREFIX}{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    opt = optimizer.state_dict()
    tensors, plain = {}, {}
    for index, values in opt["state"].items():
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                plain[f"{index}.{name}"] = value
    save_file(tensors, tmp / "optimizer.safetensors")
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, tmp / "rng.safetensors")
    py_state = random.getstate()
    np_state = np.random.get_state()
    meta = {
        **state,
        "step": step,
        "optimizer": {"param_groups": opt["param_groups"], "scalars": plain},
        "scheduler": scheduler.state_dict(),
        "python_rng": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    _write_json(tmp / STATE_FILE, meta)
    publish(tmp, final)
    for old in checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("saved %s", final)
    return final


def read_state(directory: Path) -> dict:
    """A checkpoint's trainer state (trainer_state.json), without restoring anything."""
    return json.loads((Path(directory) / STATE_FILE).read_text())


def load(directory: Path, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """Restore optimiser, scheduler and RNG from a checkpoint; returns its trainer state (the caller loads weights)."""
    directory = Path(directory)
    meta = read_state(directory)
    tensors = load_file(directory / "optimizer.safetensors")
    state: dict[int, dict] = {}
    for key, value in [*tensors.items(), *meta["optimizer"]["scalars"].items()]:
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["optimizer"]["param_groups"]})
    scheduler.load_state_dict(meta["scheduler"])
    rng = load_file(directory / "rng.safetensors")
    torch.set_rng_state(rng["torch"])
    cuda = [rng[k] for k in sorted((k for k in rng if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, values, gauss = meta["python_rng"]
    random.setstate((version, tuple(values), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    return meta


def publish(tmp: Path, final: Path) -> None:
    """Move a fully written directory into place: its files and the rename are fsynced, an older `final` replaced."""
    for path in filter(Path.is_file, tmp.iterdir()):
        with path.open("rb") as f:
            os.fsync(f.fileno())
    old = final.with_name(f".old-{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_directory(final.parent)


def _write_json(path: Path, data: dict) -> None:
    with path.open("w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())

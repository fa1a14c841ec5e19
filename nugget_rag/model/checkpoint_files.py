"""The files of a nugget checkpoint (the trained parts, not the base model): names, format, metadata, and the one
shipped for the default base model. `NuggetModel.save_pretrained` writes them; `from_pretrained` reads them
(persistence.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import LEGACY_PLACEMENT, NuggetConfig
from .base_model import DEFAULT_MODEL_NAME, BaseLM

CONFIG_FILE = "nugget_config.json"
WEIGHTS_FILE = "nugget.safetensors"
CHECKPOINT_FORMAT = "nugget-rag/checkpoint-v1"
DEFAULT_CHECKPOINT = "default"
# The adapters and Scorer shipped for the default base model (MODEL_CARD.md); `DEFAULT_CHECKPOINT` names them.
SHIPPED_CHECKPOINT = Path(__file__).parents[1] / "checkpoints" / "smollm2-135m-instruct-r10"


def write_checkpoint(directory: str | Path, parts: dict[str, dict[str, torch.Tensor]], meta: dict,
                     dtype: torch.dtype) -> Path:
    """`parts` (name -> tensors; the part "" unprefixed) as safetensors in `dtype`, and `meta` as JSON."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"{part}/{name}" if part else name: t.detach().to("cpu", dtype).contiguous()
               for part, named in parts.items() for name, t in named.items()}
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": CHECKPOINT_FORMAT})
    (directory / CONFIG_FILE).write_text(json.dumps({"format": CHECKPOINT_FORMAT, **meta}, indent=2))
    return directory


def read_checkpoint_parts(directory: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors `write_checkpoint` wrote, by part (on the CPU, in the stored dtype)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(Path(directory) / WEIGHTS_FILE, device="cpu").items():
        part, _, name = key.partition("/") if "/" in key else ("", "", key)
        parts.setdefault(part, {})[name] = tensor
    return parts


def default_checkpoint_for(base_model: str | Path | BaseLM | None) -> Path | None:
    """The shipped checkpoint when `base_model` is the default model (None or its name), else None (untrained)."""
    if base_model is None:
        name = DEFAULT_MODEL_NAME
    else:  # a directory of that name may hold other weights: load_parts compares the base digest
        name = base_model.name if isinstance(base_model, BaseLM) else Path(base_model).name
    return SHIPPED_CHECKPOINT if name == DEFAULT_MODEL_NAME and SHIPPED_CHECKPOINT.is_dir() else None


def checkpoint_config(directory: str | Path) -> NuggetConfig:
    """The nugget settings a checkpoint was trained with (one without `placement` predates it: before_prompt)."""
    return NuggetConfig.model_validate({"placement": LEGACY_PLACEMENT, **read_checkpoint_meta(directory)["config"]})


def read_checkpoint_meta(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} is not a nugget-rag checkpoint (save_pretrained writes one)")
    meta = json.loads(path.read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} has format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    return meta


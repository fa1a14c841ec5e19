"""Saving and loading a NuggetModel's trained parts (adapters, Scorer, soft prompt) onto a base model.

The file format and the shipped checkpoint are checkpoint_files.py's; this is how a model writes and reads them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Self

import torch
from torch import nn

from ..config import DECODER, ENCODER, NuggetConfig
from . import checkpoint_files as ckpt
from .adapters import Adapters
from .base_model import DEFAULT_MODEL_NAME, BaseLM, load_base_model
from .scorer import Scorer


class Persistence:
    """NuggetModel's save_pretrained / load_parts / from_pretrained, as a mixin: NuggetModel sets the attributes
    below."""

    config: NuggetConfig
    adapters: Adapters
    scorer: Scorer
    soft_prompt: nn.Parameter
    base_name: str
    base_digest: str

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.float32,
                        training: dict | None = None) -> Path:
        """Write the nugget parts (adapters, Scorer, soft prompt) as safetensors and the config as JSON.

        `dtype=torch.bfloat16` halves the file (what the package ships); loading casts to the model's dtype.
        `training` (JSON) records how the parts were trained, such as the ratios (`read_checkpoint_meta` shows it).
        """
        parts = {adapter: self.adapters.state_dict(adapter) for adapter in (ENCODER, DECODER)}
        parts |= {"scorer": self.scorer.state_dict(), "": {"soft_prompt": self.soft_prompt}}
        meta = {"base_model": self.base_name, "base_digest": self.base_digest, "config": self.config.model_dump()}
        return ckpt.write_checkpoint(directory, parts, meta | ({"training": training} if training else {}), dtype)

    def load_parts(self, directory: str | Path) -> None:
        """Load weights written by save_pretrained into this model (same config and base model)."""
        parts = self._parts_for_this_base(directory)
        for adapter in (ENCODER, DECODER):
            try:
                self.adapters.load_state_dict(adapter, parts.get(adapter, {}))
            except ValueError as err:
                raise ValueError(f"{directory}: {err}") from None
        self.scorer.load_state_dict(parts["scorer"])
        with torch.no_grad():
            self.soft_prompt.copy_(parts[""]["soft_prompt"])

    def scorer_from(self, directory: str | Path) -> Scorer:
        """A frozen copy of this model's Scorer holding the Scorer of the checkpoint in `directory` (same base
        model), on this model's device and dtype: another run's selection to compare with or to fit to."""
        scorer = copy.deepcopy(self.scorer).requires_grad_(False)
        scorer.load_state_dict(self._parts_for_this_base(directory)["scorer"])
        return scorer

    def _parts_for_this_base(self, directory: str | Path) -> dict[str, dict[str, torch.Tensor]]:
        """A checkpoint's parts, refused where they were trained on another base model."""
        meta = ckpt.read_checkpoint_meta(directory)
        if meta["base_digest"] != self.base_digest:
            raise ValueError(
                f"the checkpoint in {directory} was trained on base model {meta['base_model']!r}, whose weights "
                f"differ from the loaded {self.base_name!r}; load it with that base model"
            )
        return ckpt.read_checkpoint_parts(directory)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path | None = ckpt.DEFAULT_CHECKPOINT,
        base_model: str | Path | BaseLM | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        config: NuggetConfig | None = None,
    ) -> Self:
        """Load nugget parts from `directory` onto their base model.

        `directory="default"`: the checkpoint shipped for the default base model (MODEL_CARD.md), or a fresh model
        on any other base; `None`: a fresh (untrained) model.
        """
        if directory == ckpt.DEFAULT_CHECKPOINT:
            directory = ckpt.default_checkpoint_for(base_model)
        meta = ckpt.read_checkpoint_meta(directory) if directory is not None else None
        if config is None:
            config = ckpt.checkpoint_config(directory) if meta else NuggetConfig()
        if not isinstance(base_model, BaseLM):
            if base_model is None and meta and meta["base_model"] != DEFAULT_MODEL_NAME:
                raise ValueError(
                    f"the checkpoint in {directory} belongs to base model {meta['base_model']!r}; "
                    "pass base_model=<its checkpoint directory>"
                )
            base_model = load_base_model(base_model, device=device, dtype=dtype)
        model = cls(base_model, config)
        if directory is not None:
            model.load_parts(directory)
        return model

"""Optimisation and the schedule: AdamW over the trained parts, the learning rate's warm-up and decay, and the
compression ratio each micro-batch draws under the curriculum."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch

from ..config import DECODER, ENCODER
from ..model.nugget_model import NuggetModel
from .compiled_step import tensor_learning_rates
from .config import Optimizer, RatioCurriculum


def build_optimizer(opt: Optimizer, model: NuggetModel, compiled: bool) -> torch.optim.Optimizer:
    """AdamW, one parameter group a part (the encoder's own with `encoder_lr`); learning rates as tensors for a
    compiled step (CompiledStep)."""
    adapters = (ENCODER, DECODER) if opt.encoder_lr is None else (DECODER,)
    groups = [
        {"params": [p for name in adapters for p in model.adapter_parameters(name)], "lr": opt.lr},
        {"params": list(model.scorer.parameters()), "lr": opt.lr if opt.scorer_lr is None else opt.scorer_lr},
        {"params": [model.soft_prompt], "lr": opt.soft_prompt_lr or opt.lr},
    ]
    if opt.encoder_lr:
        groups.append({"params": list(model.adapter_parameters(ENCODER)), "lr": opt.encoder_lr})
    optimizer = torch.optim.AdamW(groups, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    if compiled:
        tensor_learning_rates(optimizer)
    return optimizer


def lr_factor(step: int, opt: Optimizer, max_steps: int, offset: int) -> float:
    """The learning rate's factor at this run's `step`: a linear warm-up, then cosine (or constant) to `max_steps`,
    counted from `offset` (the updates of a chain's earlier calls)."""
    warmup, total = opt.warmup_steps, max_steps
    step += offset
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if opt.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, opt: Optimizer, max_steps: int,
                    offset: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, opt=opt, max_steps=max_steps,
                                                                offset=offset))


def curriculum_ratio(ratios: RatioCurriculum | None, step: int, seed: int, draw: int) -> float | None:
    """The compression ratio of the micro-batch of this `draw` at `step` under the curriculum (None without one: the
    model's)."""
    if ratios is None:
        return None
    grown = min(1.0, step / ratios.ramp_steps) if ratios.ramp_steps else 1.0
    high = ratios.low * (ratios.high / ratios.low) ** grown
    u = np.random.default_rng([seed, 11, draw]).random()
    if ratios.choices is not None:
        reached = [r for r in ratios.choices if r <= high * (1 + 1e-9)]
        return float(reached[min(int(u * len(reached)), len(reached) - 1)])
    return float(ratios.low * (high / ratios.low) ** u)

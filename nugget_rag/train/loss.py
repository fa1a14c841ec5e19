"""The training loss: a batch of one objective read through the nuggets, cross-entropy and, with distillation, KL."""

from __future__ import annotations

import torch
from torch import nn

from ..config import DECODER
from ..model import NuggetModel
from .config import Distillation, Source
from .data import Batch
from .distill import Teacher, kl_loss
from .objectives import OBJECTIVES, parts_of


def compress_batch(model: NuggetModel, batch: Batch, source: Source) -> list[list]:
    """The nuggets of every example's documents (none for the full-context reference), in one encoder batch, at
    the batch's ratio."""
    if source.full_context:
        return [[] for _ in batch.documents]
    states = iter(model.compress([doc for docs in batch.documents for doc in docs], ratio=batch.ratio))
    return [[next(states) for _ in docs] for docs in batch.documents]


class ObjectiveLoss(nn.Module):
    """forward(batch) -> loss of the batch's objective (a module, so Accelerate/DDP can wrap it).

    With distillation, the loss is (1 - w) CE + w KL to the teacher; `terms` holds the last batch's CE and KL.
    """

    def __init__(self, model: NuggetModel, sources: list[Source], distill: Distillation | None = None,
                 teacher: Teacher | None = None):
        super().__init__()
        self.model = model
        self.sources = sources
        self.distill = distill if distill is not None and distill.weight > 0 else None
        if self.distill is not None and teacher is None:
            teacher = Teacher(model)
        self.teacher = teacher
        self.terms: dict[str, float] = {}

    def forward(self, batch: Batch) -> torch.Tensor:
        source = self.sources[batch.source]
        self.model.set_trainable(**vars(parts_of(source)))
        device = self.model.device
        samples = compress_batch(self.model, batch, source)
        soft_prompt = OBJECTIVES[source.objective].soft_prompt
        out = self.model.decode(
            samples, batch.input_ids.to(device), batch.token_mask.to(device), labels=batch.labels.to(device),
            soft_prompt=soft_prompt, adapter=DECODER, return_logits=False, prefixes=batch.prefixes,
        )
        if self.distill is None or source.full_context:
            self.terms = {"ce": float(out.loss.detach())}
            return out.loss
        kl = kl_loss(out.target_logits, self.teacher.target_logits(batch, soft_prompt), self.distill)
        self.terms = {"ce": float(out.loss.detach()), "kl": float(kl.detach())}
        return (1 - self.distill.weight) * out.loss + self.distill.weight * kl

"""The training loss: a batch of one objective read through the nuggets, cross-entropy and, with distillation, KL."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DECODER, ENCODER, StreamSettings
from ..generation.autoregressive import NuggetStream
from ..model.nugget_model import NuggetModel
from .batches import Batch
from .compiled_step import CompiledStep
from .config import Distillation
from .distill import Teacher, kl_loss
from .flops import FlopCounter
from .objectives import OBJECTIVES, parts_of
from .sources import Source


def compress_batch(model: NuggetModel, batch: Batch, source: Source, packed: bool = False,
                   identify: bool = True) -> list[list]:
    """The nuggets of every example's documents (none for the full-context reference), at the batch's ratio in one
    encoder batch, or at each document's own reading (one encoder batch per ratio; r = 1 is the frozen model's
    key/values of the text, as a resolution policy reads a passage whole); `packed`: several documents a row
    (NuggetModel.compress); `identify=False`: a training pass's states, not fingerprinted by the changing weights."""
    if source.full_context:
        return [[] for _ in batch.documents]
    if not any(batch.readings):
        states = iter(model.compress([doc for docs in batch.documents for doc in docs], ratio=batch.ratio,
                                     packed=packed, identify=identify))
        return [[next(states) for _ in docs] for docs in batch.documents]
    wanted = [(b, d, ratios[d] if ratios else batch.ratio) for b, (docs, ratios) in
              enumerate(zip(batch.documents, batch.readings)) for d in range(len(docs))]
    found = {}
    for ratio in dict.fromkeys(r for _, _, r in wanted):
        picked = [(b, d) for b, d, r in wanted if r == ratio]
        as_text = ratio == 1
        with torch.no_grad() if as_text else nullcontext():
            states = model.compress([batch.documents[b][d] for b, d in picked], ratio=ratio,
                                    adapter=None if as_text else ENCODER, packed=packed,
                                    identify=identify)
        found.update(zip(picked, states))
    return [[found[b, d] for d in range(len(docs))] for b, docs in enumerate(batch.documents)]


def stream_batch(model: NuggetModel, batch: Batch, settings: StreamSettings) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """Autoregressive mode: each text read by its own NuggetStream at the batch's ratio. Returns the batch with
    its labels kept only where the token before reads nuggets (`NuggetStream.reads_nuggets_from`), and the logits that
    predict those labels ([targets, vocab], row-major as `NuggetModel.decode`'s) with the targets."""
    if batch.ratio is not None:
        settings = settings.model_copy(update={"ratio": batch.ratio})
    reading = NuggetStream(model, settings)
    labels = batch.labels.clone()
    labels[:, : reading.reads_nuggets_from + 1] = -100
    logits, targets = [], []
    for ids, mask, row in zip(batch.input_ids, batch.token_mask, labels):
        n = int(mask.sum())
        kept = (row[1:n] != -100).to(model.device)
        if not kept.any():
            continue
        reading.reset()
        logits.append(reading.feed(ids[:n].tolist(), return_logits=True)[:-1][kept])
        targets.append(row[1:n].to(model.device)[kept])
    if not logits:
        raise ValueError(f"no text of this batch reaches position {reading.reads_nuggets_from}, where tokens start "
                         f"reading nuggets (window {reading.window}, segment {reading.segment}); raise "
                         "lengths.document or lower stream.window")
    return replace(batch, labels=labels), torch.cat(logits).float(), torch.cat(targets)


class ObjectiveLoss(nn.Module):
    """forward(batch) -> loss of the batch's objective (a module, so Accelerate/DDP can wrap it).

    With distillation, the loss is (1 - w) CE + w KL to the teacher; `terms` holds the last batch's CE and KL, and
    `flops` its model FLOPs (None in autoregressive mode, which is not counted). `train_encoder=False`
    (optim.encoder_lr 0) leaves the encoder adapter out of every objective's gradient; `packing` packs the encoder's
    documents (TrainConfig.packing).
    """

    def __init__(self, model: NuggetModel, sources: list[Source], distill: Distillation | None = None,
                 teacher: Teacher | None = None, stream: StreamSettings | None = None, train_encoder: bool = True,
                 packing: bool = False, compiled: CompiledStep | None = None):
        super().__init__()
        self.model = model
        self.compiled = compiled
        self.train_encoder, self.packing = train_encoder, packing
        self.sources = sources
        self.stream = stream or StreamSettings()
        self.distill = distill if distill is not None and distill.weight > 0 else None
        if self.distill is not None and teacher is None:
            teacher = Teacher(model)
        self.teacher = teacher
        self.terms: dict[str, float] = {}
        self.flops: float | None = None
        self.counter = FlopCounter(model.llama.config)
        self.teacher_counter = FlopCounter((teacher.base.model if teacher and teacher.base else model.llama).config)

    def forward(self, batch: Batch) -> torch.Tensor:
        source = self.sources[batch.source]
        parts = vars(parts_of(source))
        self.model.set_trainable(**parts | {"encoder": parts["encoder"] and self.train_encoder})
        objective = OBJECTIVES[source.objective]
        self.flops = None
        if (self.compiled is not None and self.distill is None and torch.is_grad_enabled()
                and self.compiled.fits(batch)):
            ce, nuggets = self.compiled.loss(batch)
            self.flops = self._step_flops(batch, source, nuggets, batch.targets)
            self.terms = {"ce": float(ce.detach())}
            return ce
        if objective.autoregressive:
            batch, target_logits, targets = stream_batch(self.model, batch, self.stream)
            compared = batch
            ce = F.cross_entropy(target_logits, targets)
        else:
            device = self.model.device
            states = compress_batch(self.model, batch, source, self.packing, identify=False)
            compared = batch
            if self.distill is not None and self.distill.positions == "all" and not source.full_context:
                compared = replace(batch, labels=torch.where(batch.token_mask, batch.input_ids, -100))
            out = self.model.decode(
                states, batch.input_ids.to(device), batch.token_mask.to(device),
                labels=batch.labels.to(device), soft_prompt=objective.soft_prompt, adapter=DECODER,
                return_logits=False, prefixes=batch.prefixes,
                logit_labels=None if compared is batch else compared.labels,
            )
            ce, target_logits = out.loss, out.target_logits
            self.flops = self._step_flops(batch, source, [sum(s.k for s in row) for row in states], len(target_logits))
        if self.distill is None or source.full_context:
            self.terms = {"ce": float(ce.detach())}
            return ce
        kl = kl_loss(target_logits, self.teacher.target_logits(compared, objective.soft_prompt), self.distill)
        if self.flops is not None:
            self.flops += self.teacher_counter.forward(self.teacher.rows, targets=len(target_logits))
        self.terms = {"ce": float(ce.detach()), "kl": float(kl.detach())}
        return (1 - self.distill.weight) * ce + self.distill.weight * kl

    def _step_flops(self, batch: Batch, source: Source, nuggets: list[int], targets: int) -> float:
        """The Scorer's and the encoder's passes over the documents, and the decoder's over its input (each distinct
        prompt prefix once: a row of the decoder's pass that the samples' tokens read, as they read the nuggets);
        `nuggets`: each example's count."""
        counter, parts = self.counter, parts_of(source)
        opening = len(self.model.document_opening)
        documents = [(opening + len(doc), 0) for docs in ([] if source.full_context else batch.documents) for doc in docs]
        encoder = counter.trained(documents) if parts.encoder else counter.forward(documents)
        scorer = counter.forward(documents, layers=self.model.config.scorer_layer)
        soft = self.model.soft_prompt.shape[0] if OBJECTIVES[source.objective].soft_prompt else 0
        decoder = [(soft + int(n), len(prefix) + k) for prefix, n, k in zip(batch.prefixes, batch.token_mask.sum(1), nuggets)]
        decoder += [(len(prefix), 0) for prefix in dict.fromkeys(map(tuple, batch.prefixes)) if prefix]
        return scorer + encoder + counter.trained(decoder, targets=targets)

"""Scorer warm start: before end-to-end training, teach the Scorer a training-free importance signal.

The signal is one of the importances the harness's key/value baselines keep positions by (model/importance.py):
observed attention (H2O; kvpress's ObservedAttentionPress), the attention that the frozen model's later tokens pay
each position of a document read alone; or KVzip's reconstruction attention, the most attention a position gets
while the frozen model repeats the document. The Scorer's scores over a document's positions, as a softmax, are
fitted to the signal, normalised, by a KL (a listwise ranking loss: top-k selection reads only the order of the
scores).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..model.frozen_pass import frozen_pass
from ..model.importance import observed_scores, reconstruction_passes
from ..model.nugget_model import NuggetModel
from .batches import Mixture
from .config import WarmStartSignal

log = logging.getLogger(__name__)


def importance_targets(model: NuggetModel, documents: list[list[int]],
                       signal: WarmStartSignal = "observed_attention") -> list[torch.Tensor]:
    """The signal over each document's positions but the last (always kept), summing to 1."""
    if signal == "kvzip":
        scores = [s for _, s in reconstruction_passes(model, documents)]
    else:
        scores = [observed_scores(model, run) for run in frozen_pass(model, documents, queries=True)]
    targets = []
    for ids, score in zip(documents, scores):
        mass = score[: len(ids) - 1].clamp(min=0)
        targets.append(mass / mass.sum().clamp(min=1e-12))
    return targets


def scorer_loss(model: NuggetModel, documents: list[list[int]], targets: list[torch.Tensor]) -> torch.Tensor:
    """KL(target || softmax(scores)) over each document's positions but the last, averaged over documents."""
    input_ids, opening = model.encoder_input(documents)
    scores = model.score(input_ids)[:, opening:]
    losses = []
    for row, n, target in zip(scores, (len(d) for d in documents), targets):
        log_q = F.log_softmax(row[: n - 1].float(), dim=-1)
        losses.append(F.kl_div(log_q, target.to(log_q.device), reduction="sum"))
    return torch.stack(losses).mean()


def warm_start_scorer(model: NuggetModel, batches: Mixture, steps: int, lr: float,
                      signal: WarmStartSignal = "observed_attention") -> list[float]:
    """`steps` Scorer-only AdamW steps on documents drawn from `batches` (sources with documents); the losses."""
    optimizer = torch.optim.AdamW(model.scorer.parameters(), lr=lr)
    losses = []
    for _ in tqdm(range(steps), desc="Scorer warm start"):
        documents = [d for docs in batches.next_batch().documents for d in docs if len(d) > 1]
        if not documents:
            continue
        loss = scorer_loss(model, documents, importance_targets(model, documents, signal))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    if losses:
        log.info("Scorer warm start: %d steps, KL to %s %.4f -> %.4f", len(losses), signal, losses[0], losses[-1])
    return losses

"""Scorer warm start: before end-to-end training, teach the Scorer where a document's information lies.

The signal is one of the importances the harness's key/value baselines keep positions by (model/importance.py):
observed attention (H2O; kvpress's ObservedAttentionPress), the attention that the frozen model's later tokens pay
each position of a document read alone; or KVzip's reconstruction attention, the most attention a position gets
while the frozen model repeats the document. Or, from QA sources, `answers`: the tokens of the short answers
(SQuAD's spans) found in the document, uniformly, so that the Scorer learns which tokens questions ask for without
seeing the question; optionally blended with another checkpoint's Scorer (one trained end to end for
reconstruction), so that the positions the answers do not claim keep the order reconstruction learned. The
Scorer's scores over a document's positions, as a softmax, are fitted to the signal, normalised, by a KL (a listwise
ranking loss: top-k selection reads only the order of the scores).
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..model.frozen_pass import frozen_pass
from ..model.importance import observed_scores, reconstruction_passes
from ..model.nugget_model import NuggetModel
from ..model.scorer import Scorer
from .batches import Batch, Mixture
from .config import ScorerWarmStart, WarmStartSignal

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


def answer_spans(text: str, answers: list[str], offsets: list[tuple[int, int]]) -> list[set[int]]:
    """Token positions (by their character `offsets` in `text`) of every occurrence of every answer."""
    spans = []
    for answer in dict.fromkeys(a.strip() for a in answers if a.strip()):
        for match in re.finditer(re.escape(answer), text):
            spans.append({i for i, (s, e) in enumerate(offsets) if s < match.end() and e > match.start()})
    return [s for s in spans if s]


def answer_targets(model: NuggetModel, document: list[int], references: list[str],
                   answer_tokens: int) -> torch.Tensor | None:
    """Uniform mass on the document's tokens (but the last) that overlap an occurrence of a reference of at most
    `answer_tokens` tokens; None where none occurs, or where the document's text does not tokenise back to it."""
    tok = model.tokenizer
    text = tok.decode(document)
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if encoded["input_ids"] != list(document):
        return None
    short = [str(r) for r in references
             if len(tok(str(r).strip(), add_special_tokens=False)["input_ids"]) <= answer_tokens]
    kept = sorted(set().union(*answer_spans(text, short, encoded["offset_mapping"])) - {len(document) - 1})
    if not kept:
        return None
    mass = torch.zeros(len(document) - 1)
    mass[kept] = 1.0 / len(kept)
    return mass


def order_targets(model: NuggetModel, documents: list[list[int]], scorer: Scorer) -> list[torch.Tensor]:
    """`scorer`'s order over each document's positions but the last (always kept), as a distribution falling by e
    every k = n / r ranks (the model's ratio): the order top-k selection reads, at one scale whatever the spread of
    the raw scores (an end-to-end Scorer's can lie so far apart that their softmax is one position)."""
    input_ids, opening = model.encoder_input(documents)
    scores = model.score(input_ids, scorer=scorer)[:, opening:]
    targets = []
    for row, document in zip(scores, documents):
        n = len(document) - 1
        ranks = torch.empty(n)
        ranks[row[:n].float().argsort(descending=True, stable=True).cpu()] = torch.arange(n, dtype=torch.float)
        mass = torch.exp(-ranks * model.config.ratio / len(document))
        targets.append(mass / mass.sum())
    return targets


def batch_targets(model: NuggetModel, batch: Batch, warm: ScorerWarmStart, blend: Scorer | None = None,
                  answers: bool = True) -> tuple[list[list[int]], list[torch.Tensor]]:
    """A micro-batch's documents (more than one token) and the warm start's target over each one's positions.
    `blend`: the Scorer blended into signal 'answers' (ScorerWarmStart.blend_scorer); `answers`: whether the batch's
    source is one whose references are short answers (a QA source)."""
    if warm.signal != "answers":
        documents = [d for docs in batch.documents for d in docs if len(d) > 1]
        return documents, importance_targets(model, documents, warm.signal) if documents else []
    pairs = [(d, answer_targets(model, d, refs, warm.answer_tokens) if answers else None)
             for docs, refs in zip(batch.documents, batch.references) for d in docs if len(d) > 1]
    if blend is None:
        pairs = [(d, t) for d, t in pairs if t is not None]
        return [d for d, _ in pairs], [t for _, t in pairs]
    documents = [d for d, _ in pairs]
    if not documents:
        return [], []
    learned = order_targets(model, documents, blend)
    share = warm.blend_share
    return documents, [b if a is None else (1 - share) * a + share * b for (_, a), b in zip(pairs, learned)]


def scorer_loss(model: NuggetModel, documents: list[list[int]], targets: list[torch.Tensor]) -> torch.Tensor:
    """KL(target || softmax(scores)) over each document's positions but the last, averaged over documents."""
    input_ids, opening = model.encoder_input(documents)
    scores = model.score(input_ids)[:, opening:]
    losses = []
    for row, n, target in zip(scores, (len(d) for d in documents), targets):
        log_q = F.log_softmax(row[: n - 1].float(), dim=-1)
        losses.append(F.kl_div(log_q, target.to(log_q.device), reduction="sum"))
    return torch.stack(losses).mean()


def warm_start_scorer(model: NuggetModel, batches: Mixture, warm: ScorerWarmStart,
                      answer_sources: set[int] | None = None) -> list[float]:
    """`warm.steps` Scorer-only AdamW steps on documents drawn from `batches` (sources with documents, or QA
    sources for `answers` unblended); the losses. `answer_sources`: the mixture's sources whose references are
    short answers (default: all)."""
    blend = model.scorer_from(warm.blend_scorer) if warm.blend_scorer else None
    optimizer = torch.optim.AdamW(model.scorer.parameters(), lr=warm.lr)
    losses = []
    for _ in tqdm(range(warm.steps), desc="Scorer warm start"):
        batch = batches.next_batch()
        answers = answer_sources is None or batch.source in answer_sources
        documents, targets = batch_targets(model, batch, warm, blend, answers)
        if not documents:
            continue
        loss = scorer_loss(model, documents, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    if losses:
        log.info("Scorer warm start: %d steps, KL to %s%s %.4f -> %.4f", len(losses), warm.signal,
                 f" blended with {warm.blend_scorer}'s Scorer" if blend is not None else "", losses[0], losses[-1])
    return losses

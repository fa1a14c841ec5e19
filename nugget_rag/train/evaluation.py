"""Evaluation during training: each source's dev loss (and KL with distillation), and generation scores (BLEU,
ROUGE, QA accuracy) on `eval_generate` dev examples."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..generation.decoding import GenerationSettings, generate
from ..model.nugget_model import NuggetModel
from .batches import Batch, collate
from .config import TrainConfig
from .loss import ObjectiveLoss, compress_batch
from .objectives import OBJECTIVES
from .sources import Source


@torch.no_grad()
def dev_scores(config: TrainConfig, model: NuggetModel, loss: torch.nn.Module, objective: ObjectiveLoss,
               names: list[str], dev: list[list[dict]], step: int) -> dict:
    """The eval line at `step`: per source with dev examples, its loss terms through `loss` (the prepared
    `objective`, whose terms it reads) at the model's ratio (`SOURCE/loss`) and at each of `eval_ratios`
    (`SOURCE@rR/loss`), and its generation scores."""
    was_training = model.training
    model.eval()
    line: dict = {"kind": "eval", "step": step}
    for index, (name, held) in enumerate(zip(names, dev)):
        if not held:
            continue
        for ratio in (None, *config.eval_ratios):
            line.update(loss_terms(config.batch_size, model, loss, objective, held, index, ratio,
                                   name if ratio is None else f"{name}@r{ratio:g}"))
        if config.eval_generate:
            line.update(generation_scores(model, config.batch_size, name, config.data[index],
                                          held[: config.eval_generate], index))
    model.train(was_training)
    return line


def loss_terms(batch_size: int, model: NuggetModel, loss: torch.nn.Module, objective: ObjectiveLoss,
               held: list[dict], index: int, ratio: float | None, key: str) -> dict:
    """`held`'s mean loss terms at `ratio` (None: the model's), as `key/loss` (the cross-entropy, comparable with
    and without distillation) and `key/TERM` for the others (the KL)."""
    totals: dict[str, float] = defaultdict(float)
    for start in range(0, len(held), batch_size):
        chunk = held[start : start + batch_size]
        batch = collate(chunk, index, model.tokenizer.pad_token_id)
        batch.ratio = ratio
        loss(batch)
        for term, value in objective.terms.items():
            totals[term] += value * len(chunk)
    scores = {f"{key}/loss": round(totals.pop("ce") / len(held), 4)}
    return scores | {f"{key}/{term}": round(value / len(held), 4) for term, value in totals.items()}


def generation_scores(model: NuggetModel, batch_size: int, name: str, source: Source, examples: list[dict],
                      index: int) -> dict:
    """The source's objective's scores of outputs generated for `examples` against their references."""
    pad, objective = model.tokenizer.pad_token_id, OBJECTIVES[source.objective]
    if objective.generate_tokens is None:
        return {}
    outputs, references = [], []
    for start in range(0, len(examples), batch_size):
        batch: Batch = collate(examples[start : start + batch_size], index, pad)
        samples = compress_batch(model, batch, source)
        if objective.soft_prompt:  # the output follows the soft prompt: the reference's length and a margin
            prompts = [[] for _ in samples]
            settings = GenerationSettings(max_new_tokens=max(int(batch.token_mask.sum(1).max()) + 8, 8))
        else:
            prompts = [ids[:t].tolist() for ids, t in zip(batch.input_ids, batch.target_starts)]
            settings = GenerationSettings(max_new_tokens=objective.generate_tokens)
        outputs += generate(model, samples, prompts, settings, soft_prompt=objective.soft_prompt,
                            prefixes=batch.prefixes)
        references += batch.references
    return {f"{name}/{metric}": value for metric, value in objective.score(outputs, references).items()}

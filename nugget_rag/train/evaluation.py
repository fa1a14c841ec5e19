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
    `objective`, whose terms it reads) and its generation scores."""
    was_training = model.training
    model.eval()
    line: dict = {"kind": "eval", "step": step}
    for index, (name, held) in enumerate(zip(names, dev)):
        if not held:
            continue
        totals: dict[str, float] = defaultdict(float)
        for start in range(0, len(held), config.batch_size):
            chunk = held[start : start + config.batch_size]
            loss(collate(chunk, index, model.tokenizer.pad_token_id))
            for term, value in objective.terms.items():
                totals[term] += value * len(chunk)
        # the dev loss is the cross-entropy (comparable with and without distillation); the KL beside it
        line[f"{name}/loss"] = round(totals.pop("ce") / len(held), 4)
        line.update({f"{name}/{term}": round(value / len(held), 4) for term, value in totals.items()})
        if config.eval_generate:
            line.update(generation_scores(model, config.batch_size, name, config.data[index],
                                          held[: config.eval_generate], index))
    model.train(was_training)
    return line


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

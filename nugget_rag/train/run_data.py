"""A run's data: each source's examples (from its ready set, else tokenised), the weighted mixture of their streams
the loop draws from, the dev examples evaluation reads; and ready sets written ahead of a run."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import NamedTuple

from accelerate import Accelerator
from datasets import Dataset

from ..model.base_model import load_base_model
from ..model.nugget_model import NuggetModel
from .batches import Mixture
from .config import TrainConfig
from .data import ExampleBuilder, ExampleStream, build_examples
from .ready import find_ready, load_ready, ready_name, write_ready
from .sources import Source

log = logging.getLogger(__package__ + ".trainer")  # a run's lines in train.log keep the trainer's name


class RunData(NamedTuple):
    """What a run reads: the mixture it trains on, each source's dev and training examples, the data lines of its
    metrics."""

    mixture: Mixture
    dev: list[list[dict]]
    examples: list  # each source's training examples (the Scorer warm start draws its own order)
    lines: list[dict]  # written to the metrics once a resume has trimmed them


def source_names(sources: list[Source]) -> list[str]:
    names = []
    for source in sources:
        name = f"{'full_context' if source.full_context else source.objective}:{Path(source.path).stem}"
        names.append(name if name not in names else f"{name}#{len(names)}")
    return names


def held_out(source: Source) -> Source:
    """The source its dev examples are read from (`dev_path`, else the source itself)."""
    return source.model_copy(update={"path": source.dev_path}) if source.dev_path else source


def example_builder(config: TrainConfig, source: Source, tokenizer, max_positions: int,
                    teacher_positions: int | None) -> ExampleBuilder:
    """The example builder of a source, as a run of `config` on a model of `max_positions` uses it."""
    return ExampleBuilder(source, tokenizer, config.lengths, max_positions, config.ratio_range()[0], config.seed,
                          in_user_turn=config.nugget.placement == "in_user_turn", teacher_positions=teacher_positions,
                          original_positions=config.nugget.nugget_positions == "original")


def load_ready_sets(config: TrainConfig, builders: list[ExampleBuilder], names: list[str]) -> dict:
    """(source index, split) -> (examples, skip counts) of each ready set in `config.ready_dir` (ready.py)."""
    found = {}
    for i, (source, builder, name) in enumerate(zip(config.data, builders, names)):
        for split in (source.split, source.dev_split):
            folder = find_ready(config.ready_dir, name, split) if split and not source.streaming else None
            if folder is not None:
                found[(i, split)] = load_ready(folder, builder, split)
    if config.ready_dir is not None:
        log.info("ready sets from %s: %s", config.ready_dir,
                 ", ".join(f"{names[i]} {split}" for i, split in found) or "none matched (every split is tokenised)")
    return found


def run_data(config: TrainConfig, model: NuggetModel, names: list[str], teacher_positions: int | None,
             data_seed: int, cache: Path, accelerator: Accelerator) -> RunData:
    """Every source's examples, read or tokenised (into `cache`), in streams of `data_seed`'s order."""
    cfg, tok = config, model.tokenizer
    streams, dev, train_examples, lines = [], [], [], []
    builders = [example_builder(cfg, source, tok, model.max_positions, teacher_positions) for source in cfg.data]
    ready = load_ready_sets(cfg, builders, names)  # every ready set checked before any tokenising
    for i, (source, name, builder) in enumerate(zip(cfg.data, names, builders)):
        examples, skipped = ready.get((i, source.split)) or build_examples(source, source.split, builder, cache)
        train_examples.append(examples)
        count = "streamed" if skipped is None else len(examples)
        came = " (ready set)" if (i, source.split) in ready else ""
        log.info("%s: %s training examples%s; skipped %s", name, count, came, dict(skipped or {}) or "none")
        lines.append({"kind": "data", "source": name, "examples": count, "skipped": dict(skipped or {})})
        streams.append(ExampleStream(examples, seed=data_seed * 1000 + i))
        held = []
        if source.dev_split is not None:
            examples, _ = ready.get((i, source.dev_split)) or build_examples(held_out(source), source.dev_split,
                                                                            builder, cache)
            if isinstance(examples, Dataset):
                held = [examples[j] for j in range(min(cfg.eval_examples, len(examples)))]
            else:
                held = [e for e in examples.take(4 * cfg.eval_examples) if not e["skip"]][: cfg.eval_examples]
        dev.append(held)
    mixture = Mixture(streams, [s.weight for s in cfg.data], data_seed, cfg.batch_size, tok.pad_token_id,
                      rank=accelerator.process_index, world=accelerator.num_processes,
                      group_by_length=cfg.group_by_length)
    return RunData(mixture, dev, train_examples, lines)


def write_ready_sets(config: TrainConfig, folder: Path) -> list[dict]:
    """Build every source's train and dev examples as a run of `config` would, and save them as ready sets in
    `folder` (a streamed source has none: it is tokenised as it goes). Returns each set's record and size."""
    base = load_base_model(config.base_model, device="cpu")
    teacher = None
    if config.distill.weight > 0:
        teacher = base if config.distill.teacher is None else load_base_model(config.distill.teacher, device="cpu")
        teacher = int(teacher.model.config.max_position_embeddings)
    max_positions = int(base.model.config.max_position_embeddings)
    written, cache = [], folder / "cache"
    for source, name in zip(config.data, source_names(config.data)):
        builder = example_builder(config, source, base.tokenizer, max_positions, teacher)
        for split, read in ((source.split, source), (source.dev_split, held_out(source))):
            if split is None or source.streaming:
                continue
            examples, skipped = build_examples(read, split, builder, cache)
            target = folder / ready_name(name, split)
            record = write_ready(target, examples, skipped, builder, split)
            size = sum(f.stat().st_size for f in target.iterdir())
            written.append({"set": target.name, "examples": record["examples"], "bytes": size})
    shutil.rmtree(cache, ignore_errors=True)
    return written

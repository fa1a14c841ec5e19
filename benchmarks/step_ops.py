"""Host work per training micro-batch: the aten operations one forward + backward of the recipe's loss dispatches,
by part and by batch size. On a GPU each one is a kernel launch or a view the host prepares, so when their count
does not grow with the batch, a small batch leaves the GPU waiting on the host.

    python benchmarks/step_ops.py --batch-sizes 2 8 --threads 2

For each source of the recipe (`--config`) and each batch size it draws one micro-batch (grouped by length, as the
recipe does) and counts, with a TorchDispatchMode, the operations of the Scorer, the encoder pass, the decoder's
prompt prefix (`layout`), the decoder pass, the teacher and the backward pass. Writes
benchmarks/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_name_options, made_by, run_meta, table, write_report  # noqa: E402

from nugget_rag.model import NuggetModel  # noqa: E402
from nugget_rag.train.batches import Batch  # noqa: E402
from nugget_rag.train.config import TrainConfig  # noqa: E402
from nugget_rag.train.distill import Teacher  # noqa: E402
from nugget_rag.train.trainer import Trainer  # noqa: E402

PARTS = {"scorer": (NuggetModel, "score"), "encoder": (NuggetModel, "_compress_segments"),
         "prefix": (NuggetModel, "layout"), "decoder": (NuggetModel, "decode"), "teacher": (Teacher, "target_logits")}


@contextmanager
def attributed(around):
    """Run each of PARTS' methods inside `around(part)`, a context manager, while inside."""
    originals = {part: getattr(cls, name) for part, (cls, name) in PARTS.items()}

    def wrapper(part, method):
        def run(*args, **kwargs):
            with around(part):
                return method(*args, **kwargs)
        return run

    for part, (cls, name) in PARTS.items():
        setattr(cls, name, wrapper(part, originals[part]))
    try:
        yield
    finally:
        for part, (cls, name) in PARTS.items():
            setattr(cls, name, originals[part])


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten operations under the current `part`."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.part = "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.part] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def inside(self, part: str):
        outer, self.part = self.part, part
        try:
            yield
        finally:
            self.part = outer


def one_batch_per_source(trainer: Trainer) -> Iterator[tuple[str, Batch]]:
    """The first micro-batch the recipe's mixture draws from each of its sources, with the source's name."""
    seen: set[str] = set()
    while len(seen) < len(trainer.names):
        batch = trainer.mixture.next_batch()
        name = trainer.names[batch.source]
        if name not in seen:
            seen.add(name)
            yield name, batch


def micro_batch_trainer(recipe: dict, batch_size: int, out: Path, attention: str = "auto") -> Trainer:
    """A Trainer of the recipe at `batch_size` that draws micro-batches and runs the loss, nothing else, in train mode;
    `attention` is TrainConfig.attention."""
    config = TrainConfig.model_validate(recipe | {
        "output_dir": str(out / f"b{batch_size}"), "batch_size": batch_size, "grad_accum": 1, "max_steps": 1,
        "scorer_warm_start": {"steps": 0}, "eval_every": 0, "eval_examples": 1, "eval_generate": 0,
        "attention": attention})
    trainer = Trainer(config)
    trainer.model.train()
    return trainer


def count(recipe: dict, batch_size: int, out: Path) -> list[dict]:
    trainer = micro_batch_trainer(recipe, batch_size, out)
    rows = []
    for name, batch in one_batch_per_source(trainer):
        counter = OpCounter()
        with counter, attributed(counter.inside):
            loss = trainer.loss(batch)
            counter.part = "backward"
            loss.backward()
        trainer.optimizer.zero_grad(set_to_none=True)
        rows.append({"source": name, "batch_size": batch_size, "tokens": batch.tokens,
                     "padded_tokens": batch.padded_tokens, "ops": sum(counter.counts.values()), **counter.counts})
        print(rows[-1], flush=True)
    return rows


T = TypeVar("T")


def recipe_parser(description: str, name: str) -> argparse.ArgumentParser:
    """The options of a benchmark of the recipe's training step: --config (the recipe), --threads, and where its
    report goes (--name, --out-dir)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, default=Path("configs/recipe-r10.yaml"))
    parser.add_argument("--threads", type=int)
    add_name_options(parser, name)
    return parser


def on_recipe(args: argparse.Namespace, measure: Callable[[dict, Path], T]) -> T:
    """`measure(recipe, scratch directory)` on the recipe of --config, with --threads torch threads."""
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = yaml.safe_load(args.config.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        return measure(recipe, Path(tmp))


def main() -> None:
    parser = recipe_parser(__doc__.split("\n\n")[0], "step-ops")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    rows = on_recipe(args, lambda recipe, tmp: [row for size in args.batch_sizes for row in count(recipe, size, tmp)])
    parts = ["scorer", "encoder", "prefix", "decoder", "teacher", "backward", "other"]
    meta = run_meta()
    lines = [f"# Host operations per training micro-batch ({meta['started']})", "",
             *made_by(meta, f"torch {torch.__version__}; {args.config}"), "",
             *table(["source", "batch", "tokens", "aten ops", "ops per 1k tokens", *parts],
                    ([row["source"], row["batch_size"], row["tokens"], row["ops"],
                      f"{1000 * row['ops'] / row['tokens']:.0f}", *(row.get(p, 0) for p in parts)]
                     for row in sorted(rows, key=lambda r: (r["source"], r["batch_size"]))))]
    write_report(args.out_dir / args.name, {"meta": meta, "args": vars(args), "rows": rows}, "\n".join(lines) + "\n")

if __name__ == "__main__":
    main()

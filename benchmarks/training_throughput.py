"""Training throughput of the recipe, side by side: batches as drawn against batches grouped by length.

    python benchmarks/training_throughput.py --batch-size 128 --steps 0          # padding only (data, no training)
    python benchmarks/training_throughput.py --batch-size 4 --steps 6 --threads 2 # and a few timed steps
    python benchmarks/training_throughput.py --batch-size 128 --steps 20          # on a GPU
    python benchmarks/training_throughput.py --batch-size 64 --steps 20 --group 16 --compile off step  # torch.compile
    python benchmarks/training_throughput.py --batch-size 64 --steps 20 --group 16 --attention reference fused
    python benchmarks/training_throughput.py --config configs/pretrain.yaml --records 400 --batch-size 16 --steps 8

For each `--group` value (`group_by_length`; 0: off) it draws `--padding-batches` micro-batches of the recipe's
mixture and reports the share of padding in what the passes compute; with `--steps`, it then trains that many steps
from the shipped checkpoint (no warm start, no dev evaluation) and reports updates/s, tokens/s, model TFLOP/s and MFU
(nugget_rag/train/flops.py) over the second half of the steps, the first half a warm-up (a compiled arm compiles
there); each arm's setup (loading, tokenising) and warm-up seconds are reported apart. `--records N` caps what each
source reads at its first N records (of its training split) before tokenising, `--data PATH` moves every source onto
one file (as the CPU dry run does), and `--ready-dir DIR` reads the recipe's sources as ready sets (TrainConfig.ready_dir:
no tokenising; a GPU call's READY).
`--compile off layers step` runs each arm eager, with each layer compiled and with the whole step compiled
(TrainConfig.compile), `--packing both` padded and packed; `--attention reference fused` runs
each with the decoder's float-mask attention and with the fused one (TrainConfig.attention). Writes
benchmarks/results/<name>.{md,json}, again after each arm (a time limit that stops a later arm leaves the earlier ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_name_options, device_name, made_by, run_meta, table, write_report  # noqa: E402

from nugget_rag.train.config import TrainConfig  # noqa: E402
from nugget_rag.train.records import load_records  # noqa: E402
from nugget_rag.train.sources import Source  # noqa: E402
from nugget_rag.train.trainer import Trainer  # noqa: E402


def sources(recipe: dict, data: Path | None, records: int | None, out: Path) -> list[dict]:
    """The recipe's sources without dev evaluation: each moved onto `data`, and capped at its first `records` records
    (written to a JSONL file under `out`, the whole file its training part)."""
    moved = []
    for i, entry in enumerate(recipe["data"]):
        source = Source.model_validate(entry | ({"path": str(data), "format": "auto"} if data else {}))
        source = source.model_copy(update={"dev_split": None, "dev_path": None})
        if records is not None:
            rows = list(islice(load_records(source.model_copy(update={"streaming": True}), source.split), records))
            if not rows:
                raise SystemExit(f"source {source.path} has no records in split {source.split!r}")
            path = out / f"source{i}-first{records}.jsonl"
            path.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
            source = source.model_copy(update={"path": str(path), "format": "jsonl", "split": None, "streaming": False})
        moved.append(source.model_dump(exclude_defaults=True))
    return moved


def arm_config(recipe: dict, args, group: int, compiled: str, attention: str, packing: bool, out: Path) -> TrainConfig:
    return TrainConfig.model_validate(recipe | {
        "output_dir": str(out / f"group{group}-compile-{compiled}-{attention}-packing{int(packing)}"),
        "batch_size": args.batch_size, "grad_accum": 1,
        "group_by_length": group, "max_steps": max(args.steps, 1), "scorer_warm_start": {"steps": 0},
        "eval_every": 0, "eval_generate": 0, "save_every": 10**6,
        "log_every": max(args.steps // 2, 1), "threads": args.threads, "peak_tflops": args.peak_tflops,
        "compile": compiled, "compile_backend": args.compile_backend, "compile_mode": args.compile_mode,
        "attention": attention, "packing": packing,
        "ready_dir": str(args.ready_dir) if args.ready_dir else None,
        # the speed does not depend on the weights: from the shipped checkpoint (none where the recipe starts fresh),
        # never a chain's export, which a GPU machine lacks
        "init_from": "default" if recipe.get("init_from") else None, "chain": False,
    })


def measure(recipe: dict, args, group: int, compiled: str, attention: str, packing: bool, out: Path) -> dict:
    """One arm's padding and, with --steps, its speed; its setup, warm-up and measured seconds printed apart."""
    start = time.perf_counter()
    trainer = Trainer(arm_config(recipe, args, group, compiled, attention, packing, out))
    setup = time.perf_counter() - start
    print(f"arm compile={compiled} attention={attention} packing={packing}: set up in {setup:.1f} s (loading, "
          "tokenising); training", flush=True)  # in the log before the steps, should a time limit stop them
    state = trainer.mixture.state_dict()
    batches = [trainer.mixture.next_batch() for _ in range(args.padding_batches)]
    real = sum(b.tokens for b in batches)
    padded = sum(b.packed_tokens if packing else b.padded_tokens for b in batches)
    row = {"group_by_length": group, "compile": compiled, "attention": attention, "packing": packing,
           "padding": round(1 - real / padded, 3), "batches": len(batches)}
    if args.steps:
        trainer.mixture.load_state_dict(state)
        tokens = [trainer.mixture.next_batch().tokens for _ in range(args.steps)]  # the batches train() draws
        trainer.mixture.load_state_dict(state)
        *warmup, line = trainer.train().losses
        timed = args.steps - (warmup[-1]["step"] if warmup else 0)
        measured = sum(tokens[-timed:]) / line["tokens_per_s"] if line["tokens_per_s"] else None
        row |= {k: line.get(k) for k in ("tokens_per_s", "model_tflops_per_s", "mfu")} | {
            "steps": timed, "updates_per_s": round(timed / measured, 3) if measured else None,
            "padding_trained": line["padding"], "warmup_s": warmup[-1]["elapsed_s"] if warmup else 0.0,
            "measured_s": round(measured, 2) if measured else None}
    row["setup_s"] = round(setup, 1)
    print(f"arm compile={compiled} attention={attention} packing={packing}: setup {row['setup_s']} s (loading, "
          f"tokenising), warm-up {row.get('warmup_s', 0)} s (first steps, compiling), measured "
          f"{row.get('measured_s', 0)} s ({row.get('steps', 0)} steps)", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/recipe-r10.yaml"))
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--group", type=int, nargs="+", default=[0, 16])
    parser.add_argument("--padding-batches", type=int, default=20)
    parser.add_argument("--steps", type=int, default=0, help="timed training steps per arm (0: padding only)")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--compile", nargs="+", choices=["off", "layers", "step"], default=["off"],
                        help="torch.compile arms, one each (TrainConfig.compile)")
    parser.add_argument("--compile-backend", default="inductor", help="TrainConfig.compile_backend (aot_eager: a "
                                                                      "CPU rehearsal)")
    parser.add_argument("--compile-mode", default="default", help="TrainConfig.compile_mode")
    parser.add_argument("--packing", choices=["off", "on", "both"], default="off",
                        help="arms with the documents packed into the encoder's rows (TrainConfig.packing)")
    parser.add_argument("--attention", nargs="+", choices=["auto", "reference", "fused"], default=["auto"],
                        help="the decoder's attention in training, one arm each (TrainConfig.attention)")
    parser.add_argument("--records", type=int, metavar="N", help="read only each source's first N records")
    parser.add_argument("--data", type=Path, metavar="PATH", help="every source reads this file instead")
    parser.add_argument("--ready-dir", type=Path, metavar="DIR", help="the recipe's sources as ready sets")
    add_name_options(parser, "training-throughput")
    args = parser.parse_args()
    if args.records is not None and args.records < 1:
        parser.error("--records must be at least 1")
    if args.ready_dir and (args.records or args.data):
        parser.error("--ready-dir reads the recipe's own sources, ready: drop --records and --data")
    recipe = yaml.safe_load(args.config.read_text())
    meta = run_meta(device=device_name())
    arms = {"off": [False], "on": [True], "both": [False, True]}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.ready_dir:
            recipe["data"] = sources(recipe, args.data, args.records, Path(tmp))
        for group in args.group:
            for compiled in args.compile:
                for attention in args.attention:
                    for packing in arms[args.packing]:
                        rows.append(measure(recipe, args, group, compiled, attention, packing, Path(tmp)))
                        report(rows, args, meta)


def report(rows: list[dict], args, meta: dict) -> None:
    """Write the arms measured so far to benchmarks/results/<name>.{md,json} and print the table."""
    base = rows[0]

    def ratio(row: dict) -> str:
        speed = row.get("tokens_per_s")
        return f"{speed / base['tokens_per_s']:.2f}x" if speed and base.get("tokens_per_s") else "-"

    lines = [f"# Training throughput ({meta['started']})", "",
             *made_by(meta, f"{meta['device']}; {args.config}, batch {args.batch_size}"), "",
             *table(["group_by_length", "compile", "attention", "packing", "padding", "updates/s", "tokens/s",
                     "model TFLOP/s", "MFU", "tokens/s vs the first row", "setup s", "warm-up s"],
                    ([row["group_by_length"] or "off", row["compile"], row["attention"],
                      "on" if row["packing"] else "off", f"{row['padding']:.1%}", row.get("updates_per_s") or "-",
                      row.get("tokens_per_s") or "-", row.get("model_tflops_per_s") or "-", row.get("mfu") or "-",
                      ratio(row), row["setup_s"], row.get("warmup_s", "-")] for row in rows))]
    write_report(args.out_dir / args.name, {"meta": meta, "args": vars(args), "rows": rows}, "\n".join(lines) + "\n")

if __name__ == "__main__":
    main()

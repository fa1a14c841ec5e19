"""Where a training micro-batch's time goes: torch.profiler over one forward + backward of the recipe's loss per
source, by part (benchmarks/step_ops.py's parts) and by operation. On a GPU it also reports how busy the GPU was:
the kernels' total time over the wall time. Near 1, the kernels themselves are slow (fuse or batch them); far
below, the GPU waits on the host.

    python benchmarks/step_profile.py --batch-size 64          # on a GPU, one call: about a minute
    python benchmarks/step_profile.py --batch-size 64 --attention reference --sources 2
    python benchmarks/step_profile.py --batch-size 4 --threads 2

Each source's micro-batch runs `--warmup` times unprofiled first (allocator, cuBLAS and autotuning settle), then
once under the profiler. Writes benchmarks/results/<name>.{md,json}.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from reporting import device_name, made_by, run_meta, table, write_report
from step_ops import PARTS, attributed, micro_batch_trainer, on_recipe, one_batch_per_source, recipe_parser
from torch.profiler import ProfilerActivity, profile, record_function

TOP_OPS = 15


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_sources(recipe: dict, args, out: Path) -> tuple[list[dict], list[dict]]:
    """Per source: wall, device and per-part times of one micro-batch; and the top operations over all sources."""
    trainer = micro_batch_trainer(recipe, args.batch_size, out, args.attention)
    device = trainer.model.device
    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    rows, ops = [], {}
    for name, batch in list(one_batch_per_source(trainer))[: args.sources]:
        def step():
            trainer.loss(batch).backward()
            trainer.optimizer.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            step()
        _sync(device)
        with profile(activities=activities) as prof, attributed(lambda part: record_function(f"part:{part}")):
            tick = time.perf_counter()
            step()
            _sync(device)
            wall = time.perf_counter() - tick
        events = prof.key_averages()
        kernel_s = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e6 if gpu else None
        row = {"source": name, "batch_size": args.batch_size, "tokens": batch.tokens, "wall_s": round(wall, 4),
               "tokens_per_s": round(batch.tokens / wall), "kernel_s": None if kernel_s is None else round(kernel_s, 4),
               "gpu_busy": None if kernel_s is None else round(kernel_s / wall, 3)}
        for e in events:
            if e.key.startswith("part:"):
                row[e.key[5:]] = round((e.device_time_total if gpu else e.cpu_time_total) / 1e6, 4)
            elif (e.device_type.name == "CUDA") == gpu:  # on a GPU its kernels, else the CPU's operations
                t = e.self_device_time_total if gpu else e.self_cpu_time_total
                entry = ops.setdefault(e.key, {"op": e.key, "seconds": 0.0, "calls": 0})
                entry["seconds"] += t / 1e6
                entry["calls"] += e.count
        rows.append(row)
        print(row, flush=True)
    top = sorted(ops.values(), key=lambda o: -o["seconds"])[:TOP_OPS]
    return rows, top


def main() -> None:
    parser = recipe_parser(__doc__.split("\n\n")[0], "step-profile")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--attention", choices=["auto", "reference", "fused"], default="auto",
                        help="the decoder's attention (TrainConfig.attention)")
    parser.add_argument("--sources", type=int, help="profile only the first N sources (default: all)")
    args = parser.parse_args()
    rows, top = on_recipe(args, lambda recipe, tmp: profile_sources(recipe, args, tmp))
    meta = run_meta(device=device_name())
    clock = "kernel (device)" if torch.cuda.is_available() else "CPU"
    parts = [p for p in PARTS if any(p in r for r in rows)]
    total = sum(o["seconds"] for o in top) or 1.0
    what = "kernels by their time" if torch.cuda.is_available() else "operations by self CPU time"
    lines = [f"# Where a training micro-batch's time goes ({meta['started']})", "",
             *made_by(meta, f"{meta['device']}, torch {torch.__version__}; {args.config}; attention {args.attention}"),
             "", f"Per source, one forward + backward; parts in {clock} seconds (nested: the encoder includes the "
             "Scorer, the decoder the prompt prefix).", "",
             *table(["source", "batch", "tokens", "wall s", "tokens/s", "kernel s", "GPU busy", *parts],
                    ([r["source"], r["batch_size"], r["tokens"], r["wall_s"], r["tokens_per_s"],
                      "-" if r["kernel_s"] is None else r["kernel_s"], "-" if r["gpu_busy"] is None else r["gpu_busy"],
                      *(r.get(p, "-") for p in parts)] for r in rows)),
             "", f"Top {TOP_OPS} {what}, all sources together:", "",
             *table(["operation", "seconds", "calls", "share of these"],
                    ([f"`{o['op'][:80]}`", f"{o['seconds']:.4f}", o["calls"], f"{o['seconds'] / total:.1%}"]
                     for o in top))]
    write_report(args.out_dir / args.name, {"meta": meta, "args": vars(args), "rows": rows, "top_ops": top},
                 "\n".join(lines) + "\n")

if __name__ == "__main__":
    main()

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

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import yaml
from step_ops import PARTS, attributed, micro_batch_trainer, one_batch_per_source
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/recipe-r10.yaml"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--attention", choices=["auto", "reference", "fused"], default="auto",
                        help="the decoder's attention (TrainConfig.attention)")
    parser.add_argument("--sources", type=int, help="profile only the first N sources (default: all)")
    parser.add_argument("--name", default="step-profile")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = yaml.safe_load(args.config.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        rows, top = profile_sources(recipe, args, Path(tmp))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    clock = "kernel (device)" if torch.cuda.is_available() else "CPU"
    parts = [p for p in PARTS if any(p in r for r in rows)]
    total = sum(o["seconds"] for o in top) or 1.0
    lines = [f"# Where a training micro-batch's time goes ({date.today()})", "",
             f"`python {shlex.join(sys.argv)}` on {device}, torch {torch.__version__}; {args.config}; "
             f"attention {args.attention}.", "",
             f"Per source, one forward + backward; parts in {clock} seconds (nested: the encoder includes the "
             "Scorer, the decoder the prompt prefix).", "",
             "| source | batch | tokens | wall s | tokens/s | kernel s | GPU busy | " + " | ".join(parts) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(parts)]
    for r in rows:
        lines.append(f"| {r['source']} | {r['batch_size']} | {r['tokens']} | {r['wall_s']} | {r['tokens_per_s']} | "
                     f"{r['kernel_s'] if r['kernel_s'] is not None else '-'} | "
                     f"{r['gpu_busy'] if r['gpu_busy'] is not None else '-'} | "
                     + " | ".join(str(r.get(p, "-")) for p in parts) + " |")
    what = "kernels by their time" if torch.cuda.is_available() else "operations by self CPU time"
    lines += ["", f"Top {TOP_OPS} {what}, all sources together:", "",
              "| operation | seconds | calls | share of these |", "|---|---|---|---|"]
    lines += [f"| `{o['op'][:80]}` | {o['seconds']:.4f} | {o['calls']} | {o['seconds'] / total:.1%} |" for o in top]
    results = Path("benchmarks/results")
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (results / f"{args.name}.json").write_text(json.dumps({"device": device, "args": vars(args) | {"config": str(args.config)},
                                                           "rows": rows, "top_ops": top}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

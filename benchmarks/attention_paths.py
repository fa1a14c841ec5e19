"""The decoder's two attention paths in training, side by side: one forward + backward of the loss with the
float-mask reference and with the fused bias channel (TrainConfig.attention), on the same batch, alternating.

    python benchmarks/attention_paths.py --threads 2                    # CPU: the default model, float32
    python benchmarks/attention_paths.py --batch-size 64 --repeats 10   # a GPU: bf16

Each sample reads `--documents` SQuAD dev paragraphs compressed at `--ratio` and predicts a question and its answer.
Reports the median seconds per step of each path, their ratio, and the largest difference in loss and in any
gradient between the two. Writes benchmarks/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_name_options, device_name, made_by, run_meta, table, write_report  # noqa: E402

from nugget_rag.corpora import read_squad  # noqa: E402
from nugget_rag.eval.tasks import seeded_sample  # noqa: E402
from nugget_rag.model import NuggetModel  # noqa: E402

PATHS = ("reference", "fused")


def batch(model: NuggetModel, args) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Documents (token ids) of each sample and the right-padded question + answer tokens it predicts."""
    records = seeded_sample(read_squad(args.data, split="dev"), seed=0)[: args.batch_size * args.documents]
    tokenize = lambda text: model.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    docs = [tokenize(r["context"]) for r in records]
    targets = [tokenize(f"{r['question']} {r['answers'][0]}") for r in records[:: args.documents]]
    ids, mask = model.pad(targets)
    return docs, ids, mask


def step(model: NuggetModel, docs, ids, mask, args, path: str) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    model.attention = path
    model.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    tick = time.perf_counter()
    with torch.autocast(model.device.type, torch.bfloat16, enabled=model.device.type == "cuda"):
        states = model.compress(docs, ratio=args.ratio)
        samples = [states[i : i + args.documents] for i in range(0, len(states), args.documents)]
        loss = model.decode(samples, ids, token_mask=mask, labels=ids.masked_fill(~mask, -100),
                            return_logits=False).loss
    loss.backward()
    sync()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return time.perf_counter() - tick, loss.detach(), grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/squad-dev-v1.1.json"))
    parser.add_argument("--base-model", type=Path, help="base LLaMA directory (default: SmolLM2-135M-Instruct and its "
                        "shipped checkpoint)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--documents", type=int, default=3, help="documents each sample reads")
    parser.add_argument("--ratio", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per path, after one untimed each")
    parser.add_argument("--threads", type=int)
    add_name_options(parser, "attention-paths")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = NuggetModel.from_pretrained(base_model=args.base_model)
    model.train()
    docs, ids, mask = batch(model, args)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    results = {}
    for repeat in range(args.repeats + 1):
        for path in PATHS:
            seconds, loss, grads = step(model, docs, ids, mask, args, path)
            results[path] = (loss, grads)
            if repeat:
                times[path].append(seconds)
    (loss_a, grads_a), (loss_b, grads_b) = results["reference"], results["fused"]
    loss_diff = float((loss_a - loss_b).abs())
    grad_diff = max(float((grads_a[n].float() - grads_b[n].float()).abs().max()) for n in grads_a)
    median = {p: statistics.median(t) for p, t in times.items()}
    meta = run_meta(device=device_name())
    tokens = sum(map(len, docs)) + int(mask.sum())
    lines = [f"# Decoder attention in training: reference and fused ({meta['started']})", "",
             *made_by(meta, f"{meta['device']}, torch {torch.__version__}, {model.dtype}; batch {args.batch_size}, "
                      f"{args.documents} documents a sample at r = {args.ratio:g}, {tokens} tokens a step"), "",
             *table(["path", "seconds per step (median)", "tokens/s", "vs reference"],
                    ([p, f"{median[p]:.3f}", f"{tokens / median[p]:.0f}", f"{median['reference'] / median[p]:.2f}x"]
                     for p in PATHS)),
             "", f"Largest difference between the paths: loss {loss_diff:.2e}, any gradient {grad_diff:.2e}."]
    write_report(args.out_dir / args.name, {"meta": meta, "args": vars(args), "seconds": times, "loss_diff": loss_diff,
                                       "grad_diff": grad_diff}, "\n".join(lines) + "\n")

if __name__ == "__main__":
    main()

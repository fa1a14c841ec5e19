"""Serving throughput: questions/s with concurrent clients, decoding batched (the server's BatchedGenerator) or one
request at a time, reading nuggets or Full's prompt, in one run.

    python benchmarks/serve_throughput.py [--clients 8] [--questions 32] [--max-new-tokens 32] [--threads 2]

Each client asks SQuAD dev questions about their own passage (../shared/data; nuggets compressed beforehand, as a
warm server holds them), greedy, `max-new-tokens` at most. Reports questions/s, generated tokens/s and p50/p95
latency per setting, and the ratios against Full one at a time; on a CPU also batched nuggets with int8 weights
(`NuggetModel.merged_format`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from nugget_rag import NuggetModel
from nugget_rag.batching import BatchedGenerator
from nugget_rag.config import DECODER
from nugget_rag.corpora import read_squad
from nugget_rag.generation import GenerationSettings
from nugget_rag.prompts import QA_PROMPT, chat_token_ids, full_context_messages

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad-dev-v1.1.json"


def run(batcher: BatchedGenerator, requests: list[tuple], clients: int, settings: GenerationSettings) -> dict:
    latencies, tokens, lock = [], [0], threading.Lock()
    todo = iter(requests)

    def client():
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            states, prompt, prefix, adapter = item
            start = time.perf_counter()
            steps = list(batcher.stream(states, prompt, settings, prefix=prefix, adapter=adapter))
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens[0] += len(steps)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    return {"questions_per_s": len(latencies) / wall, "tokens_per_s": tokens[0] / wall,
            "p50_s": statistics.median(latencies), "p95_s": latencies[int(0.95 * (len(latencies) - 1))],
            "mean_batch": statistics.mean(batcher.batch_sizes)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = NuggetModel.from_pretrained("default")
    tok = model.tokenizer
    records = read_squad(args.data, "dev")[: args.questions]
    with torch.inference_mode():
        states = model.compress([tok(r["context"], add_special_tokens=False)["input_ids"] for r in records])
    nugget, full = [], []
    for record, state in zip(records, states):
        instruction = QA_PROMPT.format(question=record["question"])
        prefix, prompt = model.chat_prompt([{"role": "user", "content": instruction}])
        nugget.append(([state], prompt, prefix, DECODER))
        full.append(([], chat_token_ids(tok, full_context_messages([record["context"]], instruction)), [], None))
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    rows = {}
    settings_rows = [("Full, one at a time", full, 1, "float"), ("Full, batched", full, args.clients, "float"),
                     ("nugget-rag, one at a time", nugget, 1, "float"),
                     ("nugget-rag, batched", nugget, args.clients, "float")]
    if model.device.type == "cpu":
        settings_rows.append(("nugget-rag, batched, int8 weights", nugget, args.clients, "int8"))
    for name, requests, batch, weights in settings_rows:
        model.merged_format = weights
        rows[name] = run(BatchedGenerator(model, max_batch=batch), requests, args.clients, settings)
    base = rows["Full, one at a time"]["questions_per_s"]
    print(f"{args.questions} SQuAD dev questions, {args.clients} clients, <= {args.max_new_tokens} new tokens, "
          f"{args.threads} threads, {model.device}, r = {model.config.ratio:g}\n")
    print("| setting | questions/s | x Full one at a time | tokens/s | p50 latency (s) | p95 latency (s) | mean batch |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['questions_per_s']:.2f} | {r['questions_per_s'] / base:.2f}x | {r['tokens_per_s']:.1f} | "
              f"{r['p50_s']:.1f} | {r['p95_s']:.1f} | {r['mean_batch']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

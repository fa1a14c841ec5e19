"""Time to first token: nugget-rag with cached nuggets vs the same model reading the full documents.

    python benchmarks/ttft.py --data ../shared/data/python-3.11-docs.jsonl --docs 1 4 --repeats 5

Both sides run the same generation code on the same base model and prompt; Full puts the documents' text in
the prompt (paper App. D), nugget-rag reads their nuggets from the store (already compressed).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from nugget_rag import GenerationSettings, NuggetCompressor, stream_generate
from nugget_rag.prompts import QA_PROMPT, chat_token_ids, render_instruction


def passages(path: Path, tokenizer, count: int, tokens: int) -> list[str]:
    """`count` train-split passages of about `tokens` tokens (python docs: line index % 10 != 9)."""
    out = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i % 10 == 9:
                continue
            ids = tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            if len(ids) >= tokens:
                out.append(tokenizer.decode(ids[:tokens]))
            if len(out) == count:
                return out
    raise SystemExit(f"{path} has fewer than {count} documents of {tokens} tokens")


def first_token_seconds(model, samples, prompt, adapter, before=lambda: None) -> float:
    start = time.perf_counter()
    states = before()
    stream = stream_generate(model, [states or samples], [prompt], GenerationSettings(max_new_tokens=1), adapter=adapter)
    next(stream)
    elapsed = time.perf_counter() - start
    stream.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data/python-3.11-docs.jsonl"))
    parser.add_argument("--docs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ttft.json"))
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    compressor = NuggetCompressor.from_pretrained(args.checkpoint)
    model, tok = compressor.model, compressor.model.tokenizer
    texts = passages(args.data, tok, max(args.docs), args.tokens)
    question = "What does this module do?"
    rows = []
    for count in args.docs:
        docs = texts[:count]
        compressor.states(docs)  # compress once: later questions read the cache
        nugget_prompt = chat_token_ids(tok, [{"role": "user", "content": render_instruction(QA_PROMPT, question)}])
        full_text = "\n\n".join(docs) + "\n" + render_instruction(QA_PROMPT, question)
        full_prompt = chat_token_ids(tok, [{"role": "user", "content": full_text}])
        timings = {"full": [], "nuggets": []}
        for _ in range(args.repeats + 1):  # the first round warms up
            timings["full"].append(first_token_seconds(model, [], full_prompt, adapter=None))
            timings["nuggets"].append(
                first_token_seconds(model, None, nugget_prompt, adapter="decoder", before=lambda: compressor.states(docs)))
        full, nug = (statistics.median(v[1:]) for v in (timings["full"], timings["nuggets"]))
        states = compressor.states(docs)
        cfg = model.llama.config
        kv_full = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * len(full_prompt) * model.dtype.itemsize
        kv_nuggets = sum(s.keys.numel() + s.values.numel() for s in states) * model.dtype.itemsize
        rows.append({"documents": count, "doc_tokens": sum(s.n for s in states), "nuggets": sum(s.k for s in states),
                     "full_prompt_tokens": len(full_prompt), "nugget_prompt_tokens": len(nugget_prompt),
                     "ttft_full_s": full, "ttft_nuggets_s": nug, "speedup": full / nug,
                     "kv_bytes_full": kv_full, "kv_bytes_nuggets": kv_nuggets})
        print(json.dumps(rows[-1]))
    result = {"date": date.today().isoformat(), "machine": f"{platform.machine()} {platform.processor() or ''} "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}, {model.device}, {model.dtype}",
              "model": model.base_name, "ratio": compressor.effective_ratio, "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("| documents | doc tokens | nuggets | TTFT full (s) | TTFT nuggets (s) | speed-up | KV full / nuggets |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['documents']} | {r['doc_tokens']} | {r['nuggets']} | {r['ttft_full_s']:.3f} | "
              f"{r['ttft_nuggets_s']:.3f} | {r['speedup']:.1f}x | {r['kv_bytes_full'] / r['kv_bytes_nuggets']:.1f}x |")


if __name__ == "__main__":
    main()

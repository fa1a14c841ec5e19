"""Speed and memory, Full against nugget-rag, measured in the same run on the same model and generation code.

For 1, 4 and 16 documents of about 512 tokens (the data's `split`, first tokens of each document), and a QA prompt:
- time to first token: Full prefills documents + question; nugget-rag reads the documents' nuggets from the store
  (a memory hit, included in the time) and prefills the question only;
- per-token decode latency: the mean time of the next `decode_steps - 1` greedy tokens, with the cache (end of
  sequence ignored, so every row times the same number of steps);
- key/value bytes held: of the documents (Full: their tokens; nugget-rag: their nuggets) and in all at the first
  token (the prompt's own keys/values added);
- compression throughput: document tokens compressed per second (model.compress, no store);
- store hit latency: getting all the documents' states from the in-memory LRU and from a directory store with a
  cold LRU (read, verified, parsed).
Medians over `repeats` after one warm-up. Runs on the model's device (CPU, or GPU when the run uses one). The
setup (tokenising the documents) and the warm-ups (compiling, recording CUDA graphs) are timed apart from the rest.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

import torch

from ..components.compressor import NuggetCompressor
from ..components.resolution import default_resolution
from ..corpora import read_documents
from ..generation import decoding as generation
from ..generation.decoding import GenerationSettings, stream_generate
from ..prompts import QA_PROMPT, chat_token_ids, full_context_messages
from ..state.nugget_state import KV_FORMATS
from ..state.store import NuggetStore
from .systems.base import Env

QUESTION = "What does this module do?"
T = TypeVar("T")


@contextmanager
def no_eos():
    saved = generation.eos_ids
    generation.eos_ids = lambda model: set()
    try:
        yield
    finally:
        generation.eos_ids = saved


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def timed_generation(model, samples, prompt, adapter, steps: int, before=None, prefix=()) -> tuple[float, float]:
    """(seconds to the first token, mean seconds per later token); `before` and the prompt prefix run inside the
    first-token time."""
    _sync(model)
    start = time.perf_counter()
    if before is not None:
        samples = before()
    stream = stream_generate(model, [samples], [prompt], GenerationSettings(max_new_tokens=steps), adapter=adapter,
                             prefixes=[prefix])
    next(stream)
    _sync(model)
    first = time.perf_counter() - start
    count = 0
    for _ in stream:
        count += 1
    _sync(model)
    rest = time.perf_counter() - start - first
    return first, rest / max(count, 1)


def repeated(repeats: int, run: Callable[[], T], warmups: list[float]) -> list[T]:
    """`run()`'s results of `repeats` calls after one warm-up, whose seconds are appended to `warmups`."""
    start = time.perf_counter()
    run()
    warmups.append(time.perf_counter() - start)
    return [run() for _ in range(repeats)]


def _kv_bytes(model, tokens: int) -> int:
    cfg = model.llama.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * tokens * model.dtype.itemsize


def passages(env: Env, cfg, count: int, tokens: int) -> list[list[int]]:
    tok = env.model.tokenizer
    out = []
    for rec in read_documents(cfg.data_file("speed"), cfg.split_for("speed")):
        ids = tok(rec["text"], add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == count:
            break
    return out


def _adaptive_entry(model, docs: list[str], prompt: list[int], prefix: list[int], sc, row: dict,
                    warmups: list[float]) -> dict:
    """The default resolution policy over states already in the store (nuggets and text states): time to first token
    including the policy's probe and the store reads, per-token decoding, and the bytes stored per document token."""
    compressor = NuggetCompressor(model=model, text_states=True, keep_ratio=1)  # floor 1: the bytes of every floor
    compressor.invoke(docs)  # ingest: every state the policy may read is stored
    policy = default_resolution()
    plans = []

    def read():
        planned = policy.read(QUESTION, docs, compressor)
        plans.append(planned.readings)
        return [found.state for found in planned.found]

    adapter = policy.decoder_adapter(policy.plan(QUESTION, docs, compressor))
    with no_eos():
        firsts, per_token = zip(*repeated(sc.repeats, lambda: timed_generation(
            model, None, prompt, adapter, sc.decode_steps, before=read, prefix=prefix), warmups))
    stored = [compressor.lookup([d])[0].stored for d in docs]
    text = [compressor.lookup([d], 1.0, adapter=None)[0].stored for d in docs]
    entry = {"policy": repr(policy), "positions": sum(r.positions for r in plans[-1]),
             "ttft_s": statistics.median(firsts), "decode_s_per_token": statistics.median(per_token),
             "stored_bytes_per_token_by_floor": {
                 f"{floor:g}": {fmt: sum(len(s.compact(fmt).to_bytes()) for s in (state.with_floor(floor) for state in stored))
                                / row["doc_tokens"] for fmt in KV_FORMATS} for floor in (1.0, 2.0, 4.0, 10.0)},
             "text_state_bytes_per_token": {fmt: sum(len(s.compact(fmt).to_bytes()) for s in text) / row["doc_tokens"]
                                            for fmt in KV_FORMATS}}
    if "ttft_full_s" in row:
        entry["ttft_speedup"] = row["ttft_full_s"] / entry["ttft_s"]
    return entry


def run_speed(env: Env, cfg) -> dict:
    model, tok, sc = env.model, env.model.tokenizer, cfg.speed
    began = time.perf_counter()
    docs_ids = passages(env, cfg, max(sc.documents), sc.doc_tokens)
    tokenised = time.perf_counter() - began
    warmups: list[float] = []
    texts = [tok.decode(ids) for ids in docs_ids]
    instruction = QA_PROMPT.format(question=QUESTION)
    nugget_prefix, nugget_prompt = model.chat_prompt([{"role": "user", "content": instruction}])
    nugget_tokens = len(nugget_prefix) + len(nugget_prompt)
    rows, skipped = [], []
    median = statistics.median
    for count in sc.documents:
        if count > len(docs_ids):
            skipped.append({"documents": count, "reason": f"only {len(docs_ids)} documents of {sc.doc_tokens} tokens"})
            continue
        ids, docs = docs_ids[:count], texts[:count]
        full_prompt = chat_token_ids(tok, full_context_messages(docs, instruction))
        row = {"documents": count, "doc_tokens": sum(map(len, ids)), "full_prompt_tokens": len(full_prompt),
               "nugget_prompt_tokens": nugget_tokens, "kv_bytes_full_docs": _kv_bytes(model, sum(map(len, ids))),
               "kv_bytes_full_total": _kv_bytes(model, len(full_prompt))}
        if len(full_prompt) + sc.decode_steps <= model.max_positions:
            with no_eos():
                firsts, per_token = zip(*repeated(
                    sc.repeats, lambda: timed_generation(model, [], full_prompt, None, sc.decode_steps), warmups))
            row["ttft_full_s"], row["decode_full_s_per_token"] = median(firsts), median(per_token)
        else:
            row["full_skipped"] = f"Full prompt exceeds the model's {model.max_positions} positions"
        row["nugget"] = {}
        for ratio in cfg.ratios:
            def compress(ids=ids, ratio=ratio) -> tuple[float, list]:
                _sync(model)
                start = time.perf_counter()
                states = model.compress(ids, ratio=ratio)
                _sync(model)
                return time.perf_counter() - start, states

            compress_times, compressed = zip(*repeated(sc.repeats, compress, warmups))
            states = compressed[-1]
            memory = NuggetStore()
            with tempfile.TemporaryDirectory() as folder:
                disk = NuggetStore(directory=folder)
                for text, state in zip(docs, states):
                    memory.put(text, state)
                    disk.put(text, state)
                fingerprint = states[0].fingerprint
                hit_memory, hit_disk = [], []
                for _ in range(sc.repeats + 1):
                    start = time.perf_counter()
                    found = [memory.get(t, fingerprint) for t in docs]
                    hit_memory.append(time.perf_counter() - start)
                    cold = NuggetStore(directory=folder)
                    start = time.perf_counter()
                    found += [cold.get(t, fingerprint) for t in docs]
                    hit_disk.append(time.perf_counter() - start)
                    if any(state is None for state in found):
                        raise RuntimeError("a stored nugget state was not found again (store miss in the benchmark)")
            with no_eos():
                firsts, per_token = zip(*repeated(sc.repeats, lambda store=memory, fp=fingerprint, texts=docs:
                                                  timed_generation(model, None, nugget_prompt, "decoder",
                                                                   sc.decode_steps, prefix=nugget_prefix,
                                                                   before=lambda: [store.get(t, fp) for t in texts]),
                                                  warmups))
            nuggets = sum(s.k for s in states)
            kv_docs = sum(s.keys.numel() * s.keys.element_size() + s.values.numel() * s.values.element_size()
                          for s in states)
            entry = {
                "nuggets": nuggets, "ttft_s": median(firsts), "decode_s_per_token": median(per_token),
                "stored_bytes_per_token": {fmt: sum(len(s.compact(fmt).to_bytes()) for s in states) / row["doc_tokens"]
                                           for fmt in KV_FORMATS},
                "kv_bytes_docs": kv_docs, "kv_bytes_total": kv_docs + _kv_bytes(model, nugget_tokens),
                "compress_tokens_per_s": row["doc_tokens"] / median(compress_times),
                "store_hit_memory_s": median(hit_memory[1:]), "store_hit_disk_s": median(hit_disk[1:]),
            }
            if "ttft_full_s" in row:
                entry["ttft_speedup"] = row["ttft_full_s"] / entry["ttft_s"]
                entry["decode_speedup"] = row["decode_full_s_per_token"] / entry["decode_s_per_token"]
            entry["kv_reduction_docs"] = row["kv_bytes_full_docs"] / kv_docs
            entry["kv_reduction_total"] = row["kv_bytes_full_total"] / entry["kv_bytes_total"]
            row["nugget"][f"{ratio:g}"] = entry
        if sc.policy:
            row["adaptive"] = _adaptive_entry(model, docs, nugget_prompt, nugget_prefix, sc, row, warmups)
        rows.append(row)
    total = time.perf_counter() - began
    return {"device": str(model.device), "question": QUESTION, "doc_tokens": sc.doc_tokens, "repeats": sc.repeats,
            "decode_steps": sc.decode_steps, "rows": rows, "skipped": skipped,
            "setup_s": {"documents": round(tokenised, 2), "warmups": round(sum(warmups), 2)},
            "measured_s": round(total - tokenised - sum(warmups), 2)}

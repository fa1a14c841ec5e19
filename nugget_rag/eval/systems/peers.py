"""Peer packages run themselves: NVIDIA kvpress (SnapKV, ObservedAttention presses) and Microsoft llmlingua.

They run in a separate virtual environment (kvpress pins transformers < 5.3), through `peer_worker.py` in a
subprocess, on the same base model directory and the same prompt text as Full: kvpress's pipeline puts the
context and then the question in one user turn of the chat template, which is Full's prompt when the context is
the documents joined by blank lines. kvpress compresses the whole context it prefills (the chat template's
system turn included) at compression_ratio = 1 - 1/r, per layer and head as the press decides, and generates
with its own greedy loop; llmlingua (rate = 1/r, each document alone, no question) returns text that the
harness reads like Full. Without the peer environment these systems report themselves unavailable.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from .base import Env, Reading, Skipped, System, register

WORKER = Path(__file__).resolve().parent.parent / "peer_worker.py"
DEFAULT_PEER_PYTHON = Path(__file__).resolve().parents[3] / ".venv-peers" / "bin" / "python"


def peer_python(env: Env) -> str | None:
    path = env.peer_python or os.environ.get("NUGGET_RAG_PEER_PYTHON") or str(DEFAULT_PEER_PYTHON)
    return path if Path(path).is_file() else None


class PeerProcess:
    """One worker process per (interpreter, model directory), shared by the peer systems of a run."""

    def __init__(self, python: str, model_dir: str, threads: int | None):
        environment = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=environment)
        self._send({"model": model_dir, "threads": threads})
        ready = self._receive()
        if not ready.get("ready"):
            raise RuntimeError(f"peer worker failed to start: {ready}")

    def _send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def _receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer worker exited (code {self.proc.poll()})")
        return json.loads(line)

    def ask(self, message: dict) -> dict:
        self._send(message)
        return self._receive()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _process(env: Env) -> PeerProcess:
    key = ("peer-process", peer_python(env), env.base_model_path)
    procs = env.cache_for("peer-processes")
    if key not in procs:
        procs[key] = PeerProcess(key[1], key[2], env.threads)
    return procs[key]


def close_peers(env: Env) -> None:
    for proc in env.cache_for("peer-processes").values():
        proc.close()
    env.cache.pop("peer-processes", None)


class PeerSystem(System):
    def available(self, env: Env) -> str | None:
        if peer_python(env) is None:
            return (f"peer environment not found ({DEFAULT_PEER_PYTHON}; make it with scripts/install_peers.sh "
                    "or set NUGGET_RAG_PEER_PYTHON)")
        if env.base_model_path is None:
            return "the base model has no directory a peer package can load"
        if env.model.device.type != "cpu":
            return "peer systems run on CPU only in this harness"
        return None


class KVPressSystem(PeerSystem):
    press = ""
    question_in_context = False  # True: the instruction is part of the compressed context (query-aware)
    kinds = frozenset({"qa", "summarization", "autoencoding"})

    def prepare(self, env: Env, queries, ratio):
        proc = _process(env)
        out = []
        for q in queries:
            if any(not d.strip() for d in q.documents):
                out.append(Skipped("empty document"))
                continue
            context = "\n\n".join(q.documents) + "\n\n"
            context, question = (context + q.instruction, "") if self.question_in_context else (context, q.instruction)
            reply = proc.ask({"op": "kvpress", "press": self.press, "context": context,
                              "question": question, "compression_ratio": 1 - 1 / ratio,
                              "max_new_tokens": q.max_new_tokens})
            if "error" in reply:
                out.append(Skipped(f"peer error: {reply['error'][:120]}"))
            else:
                out.append(Reading(answer=reply["answer"]))  # kept slots: decided inside kvpress, not reported
        return out


@register("kvpress_snapkv")
class KVPressSnapKV(KVPressSystem):
    label = "SnapKV (kvpress peer)"
    press = "snapkv"
    description = ("kvpress's SnapKVPress run by kvpress itself; as kvpress runs it, the observation window is the end "
                   "of the context (the question is not seen at compression). kvpress always keeps its 64-token window, "
                   "so when the budget (1/r of the context) is under 64 tokens, as for most SQuAD paragraphs at "
                   "r = 10, every kept token comes from the window.")


@register("kvpress_snapkv_query")
class KVPressSnapKVQuery(KVPressSystem):
    label = "SnapKV, question in context (kvpress peer; reference)"
    press = "snapkv"
    question_in_context = True
    reference = True
    description = ("kvpress's SnapKVPress with the instruction at the end of the compressed context, so its observation "
                   "window (the last 64 tokens, kept) holds the question: query-aware, as SnapKV was proposed. With "
                   "a budget under 64 tokens the kept tokens all come from that window (question and the document's end).")


@register("kvpress_observed_attention")
class KVPressObserved(KVPressSystem):
    label = "ObservedAttention (kvpress peer)"
    press = "observed_attention"
    description = "kvpress's ObservedAttentionPress (eager attention) run by kvpress itself."


@register("llmlingua")
class LLMLinguaPeer(PeerSystem):
    label = "LLMLingua (llmlingua peer)"
    description = ("Microsoft's llmlingua PromptCompressor on the same base model, rate = 1/r per document, no "
                   "question; its text is read like Full.")

    def prepare(self, env: Env, queries, ratio):
        proc = _process(env)
        cache = env.cache_for(f"{self.name}@{ratio}")
        out = []
        for q in queries:
            if any(not d.strip() for d in q.documents):
                out.append(Skipped("empty document"))
                continue
            texts = []
            for d in q.documents:
                if d not in cache:
                    reply = proc.ask({"op": "llmlingua", "text": d, "rate": 1 / ratio})
                    cache[d] = reply
                texts.append(cache[d])
            errors = [t["error"] for t in texts if "error" in t]
            if errors:
                out.append(Skipped(f"peer error: {errors[0][:120]}"))
                continue
            compressed = [t["text"] for t in texts]
            if q.kind == "lm":
                ids = [env.model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in compressed]
                out.append(Reading(texts=compressed, text_ids=ids))
            else:
                out.append(Reading(texts=compressed))
        return out

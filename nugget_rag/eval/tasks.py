"""The evaluation tasks: readers (any file in the shared/data formats, splits honoured) and scoring.

| task          | kind          | data (default file)                  | metric                                     |
|---------------|---------------|--------------------------------------|--------------------------------------------|
| autoencoding  | autoencoding  | python-3.11-docs.jsonl (any texts)   | BLEU of the reconstruction, by length      |
| squad         | qa            | squad-dev-v1.1.json                  | accuracy, App. E normalisation, <= 64 tok. |
| cnndm         | summarization | cnndm-test-250.jsonl                 | ROUGE-1/2/L F1                              |
| lm            | lm            | wikitext-2-raw-test.txt (any texts)  | perplexity of the last tokens (Table 1)     |
| hotpotqa      | qa            | hotpotqa-dev-distractor-53.json      | accuracy, 10 paragraphs compressed apart   |
| long_cnndm    | summarization | cnndm-test-250.jsonl                 | ROUGE, `long_articles` articles joined     |
| squad_rag     | qa            | squad-dev-v1.1.json                  | accuracy; gold + k-1 retrieved paragraphs  |
| hotpotqa_rag  | qa            | hotpotqa-dev-distractor-53.json      | accuracy; 10 paragraphs in retriever order |

An example that cannot be evaluated (no gold answer, an empty document, a Full prompt longer than the model's
positions, a text shorter than the LM window) is counted by reason and reported, never dropped silently. Every
system then runs on the same remaining examples (the Full prompt is the longest, so it decides what fits). The
exception is long_cnndm, whose documents are meant to exceed the positions: a system that cannot read one (Full)
reports it skipped.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..corpora import DataError, read_documents, read_hotpotqa, read_squad, read_summarization
from ..prompts import SUMMARY_OF_DOCUMENT, SUMMARY_PROMPT, chat_token_ids, full_context_messages, render_instruction
from .config import EvalConfig
from .metrics import answer_correct, bleu, rouge
from .rag import retrieved
from .systems.base import Query

AUTOENCODE_PROMPT = "Please repeat the above document word for word."
LONG_SUMMARY_PROMPT = SUMMARY_OF_DOCUMENT  # the summary chain's "nuggets" reading's
KINDS = {"autoencoding": "autoencoding", "squad": "qa", "cnndm": "summarization", "lm": "lm", "hotpotqa": "qa",
         "long_cnndm": "summarization", "squad_rag": "qa", "hotpotqa_rag": "qa"}
MAIN_METRIC = {"autoencoding": "bleu", "squad": "accuracy", "cnndm": "rougeL", "lm": "perplexity", "hotpotqa": "accuracy",
               "long_cnndm": "rougeL", "squad_rag": "accuracy", "hotpotqa_rag": "accuracy"}
HIGHER_IS_BETTER = {"bleu": True, "accuracy": True, "rougeL": True, "perplexity": False}


@dataclass
class Example:
    id: str
    query: Query
    references: list[str]
    bucket: int | None = None  # autoencoding: the input length group


@dataclass
class TaskData:
    name: str
    kind: str
    source: str
    split: str | None
    examples: list[Example]
    skipped: Counter = field(default_factory=Counter)
    examined: int = 0

    @property
    def metric(self) -> str:
        return MAIN_METRIC[self.name]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def seeded_sample(records: Sequence[dict], seed: int) -> list[dict]:
    """The records shuffled with `seed`: --sample random's order, whose first N are its sample."""
    records = list(records)
    random.Random(seed).shuffle(records)
    return records


def _sampled(records: list[dict], cfg: EvalConfig) -> list[dict]:
    """The records in file order, or in seeded_sample's order for --sample random."""
    return records if cfg.sample == "first" else seeded_sample(records, cfg.sample_seed)


class _Collector:
    """Keeps examples that fit the model, counts the rest by reason, stops at the limit."""

    def __init__(self, model, limit: int | None, fit_full: bool = True):
        self.model, self.limit, self.fit_full = model, limit, fit_full
        self.examples: list[Example] = []
        self.skipped: Counter = Counter()
        self.examined = 0

    @property
    def full(self) -> bool:
        return self.limit is not None and len(self.examples) >= self.limit

    def skip(self, reason: str) -> None:
        self.examined += 1
        self.skipped[reason] += 1

    def offer(self, example: Example) -> None:
        self.examined += 1
        q = example.query
        if not q.documents or any(len(ids) == 0 for ids in q.document_ids):
            self.skipped["empty document"] += 1
            return
        if q.kind == "lm":
            need = sum(map(len, q.document_ids)) + len(q.context_ids) + len(q.target_ids)
        else:
            prompt = chat_token_ids(self.model.tokenizer, full_context_messages(q.documents, q.instruction))
            need = len(prompt) + q.max_new_tokens
        if self.fit_full and need > self.model.max_positions:
            self.skipped[f"Full prompt + output exceed the model's {self.model.max_positions} positions"] += 1
            return
        self.examples.append(example)


def _only(examples: list[Example], ids: Sequence[str], task: str) -> list[Example]:
    """The examples whose id is in `ids`, in their order; an id that is not among them is an error."""
    missing = set(ids) - {e.id for e in examples}
    if missing:
        raise DataError(f"task {task}: --only-ids names {len(missing)} example(s) the run does not hold, e.g. "
                        f"{sorted(missing)[0]!r}: give the split, sample and limit of the run whose answers it reruns")
    wanted = set(ids)
    return [e for e in examples if e.id in wanted]


def load_task(name: str, cfg: EvalConfig, model) -> TaskData:
    """Read a task's file (its split) into examples; raises DataError for missing files or fields."""
    path = cfg.data_file(name)
    split = cfg.split_for(name)
    tok = model.tokenizer
    limit = cfg.limit_for(name)
    col = _Collector(model, limit, fit_full=name != "long_cnndm")
    if name in ("squad", "hotpotqa", "squad_rag", "hotpotqa_rag"):
        records = read_squad(path, split) if name.startswith("squad") else read_hotpotqa(path, split)
        records = _sampled(records, cfg)
        if name.endswith("_rag"):
            records = retrieved(records, cfg.rag_passages if name == "squad_rag" else None)
        for rec in records:
            if col.full:
                break
            answers = [a for a in rec["answers"] if str(a).strip()]
            if not answers:
                col.skip("no gold answer")
                continue
            docs = [rec["context"]] if name == "squad" else list(rec["documents"])
            query = Query("qa", docs, [_ids(tok, d) for d in docs], render_instruction(cfg.qa_prompt, rec["question"]),
                          max_new_tokens=cfg.qa_max_new_tokens, question=rec["question"], gold=rec.get("gold", []))
            col.offer(Example(rec["id"], query, answers))
    elif name == "cnndm":
        for rec in _sampled(read_summarization(path, split), cfg):
            if col.full:
                break
            if not str(rec["summary"]).strip():
                col.skip("empty reference summary")
                continue
            query = Query("summarization", [rec["document"]], [_ids(tok, rec["document"])], SUMMARY_PROMPT,
                          max_new_tokens=cfg.summary_max_new_tokens)
            col.offer(Example(rec["id"], query, [rec["summary"]]))
    elif name == "long_cnndm":
        records = [r for r in read_summarization(path, split) if str(r["summary"]).strip()]
        size = cfg.long_articles
        for start in range(0, len(records) - size + 1, size):
            if col.full:
                break
            group = records[start : start + size]
            text = "\n\n".join(r["document"] for r in group)
            query = Query("summarization", [text], [_ids(tok, text)], LONG_SUMMARY_PROMPT,
                          max_new_tokens=cfg.summary_max_new_tokens)
            col.offer(Example("+".join(str(r["id"]) for r in group), query, ["\n".join(r["summary"] for r in group)]))
    elif name == "autoencoding":
        per_bucket: Counter = Counter()
        for rec in read_documents(path, split):
            if limit is not None and all(per_bucket[L] >= limit for L in cfg.ae_lengths):
                break
            ids = _ids(tok, rec["text"])
            for length in cfg.ae_lengths:
                if limit is not None and per_bucket[length] >= limit:
                    continue
                if len(ids) < length:
                    col.skip(f"text shorter than {length} tokens")
                    continue
                text = tok.decode(ids[:length])
                query = Query("autoencoding", [text], [_ids(tok, text)], AUTOENCODE_PROMPT,
                              max_new_tokens=cfg.ae_max_new_tokens or math.ceil(1.25 * length) + 8)
                before = len(col.examples)
                col.offer(Example(f"{rec['id']}@{length}", query, [text], bucket=length))
                per_bucket[length] += len(col.examples) - before
    elif name == "lm":
        h, c, t = cfg.lm.history, cfg.lm.context, cfg.lm.target
        for rec in read_documents(path, split):
            if col.full:
                break
            ids = _ids(tok, rec["text"])
            if len(ids) < h + c + t:
                col.skip(f"text shorter than history + context + target = {h + c + t} tokens")
                continue
            history = ids[:h]
            query = Query("lm", [tok.decode(history)], [history], "", context_ids=ids[h : h + c],
                          target_ids=ids[h + c : h + c + t])
            col.offer(Example(rec["id"], query, []))
    else:
        raise ValueError(f"unknown task {name!r}")
    if cfg.only_ids is not None:
        col.examples = _only(col.examples, cfg.only_ids, name)
    if not col.examples:
        detail = ", ".join(f"{n} {r}" for r, n in col.skipped.items()) or "the file has no records"
        raise DataError(f"task {name}: no usable example in {path} (split {split}): {detail}")
    return TaskData(name, KINDS[name], str(path), split, col.examples, col.skipped, col.examined)


def score(task: TaskData, examples: Sequence[Example], outputs: Sequence) -> dict[str, float]:
    """Metrics of the outputs (texts; for lm, (nll_sum, tokens) pairs) against the examples' references."""
    if not examples:
        return {}
    if task.kind == "lm":
        nll = sum(o[0] for o in outputs)
        count = sum(o[1] for o in outputs)
        return {"perplexity": math.exp(nll / count), "nll_per_token": nll / count, "tokens": count}
    if task.kind == "qa":
        correct = [answer_correct(o, e.references) for o, e in zip(outputs, examples)]
        return {"accuracy": 100 * sum(correct) / len(correct)}
    if task.kind == "summarization":
        return rouge(list(outputs), [e.references[0] for e in examples])
    if task.kind == "autoencoding":
        metrics = {"bleu": bleu(list(outputs), [e.references[0] for e in examples])}
        for length in sorted({e.bucket for e in examples}):
            pairs = [(o, e.references[0]) for o, e in zip(outputs, examples) if e.bucket == length]
            metrics[f"bleu@{length}"] = bleu([p for p, _ in pairs], [r for _, r in pairs])
        return metrics
    raise ValueError(f"unknown kind {task.kind!r}")

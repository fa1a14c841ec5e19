"""Sequence-level distillation data for QA fine-tuning: the frozen base model's own answers to SQuAD questions.

    python scripts/teacher_answers.py --squad ../shared/data/squad-dev-v1.1.json --split train --n 1400 \\
        --out runs/kd/squad-teacher.jsonl

Each answer is Full's (the eval harness's reference): the passage as text in the prompt, greedy, at most 64 new
tokens, adapters off. Only answers that contain a gold answer (App. E normalisation) are kept; one cut off by the
token limit is shortened to its last complete sentence when that still contains a gold answer. The output is a
QA JSONL file (`context`, `question`, `answers`; `gold` and `id` for reference) that trains as
`--data qa:<file>` (TRAINING.md, "Distilled answers"). Re-running appends only the questions not yet answered.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from nugget_rag import corpora
from nugget_rag.generation import GenerationSettings, generate
from nugget_rag.metrics import answer_correct
from nugget_rag.model import NuggetModel
from nugget_rag.prompts import QA_PROMPT, chat_token_ids, full_context_messages, render_instruction

log = logging.getLogger("teacher_answers")
SENTENCE_ENDS = (".", "!", "?", '"', ")")


def kept_answer(answer: str, gold: Sequence[str]) -> str | None:
    """The answer to train on, or None when it contains no gold answer."""
    answer = answer.strip()
    if not answer_correct(answer, gold):
        return None
    end = answer.rfind(". ")
    if not answer.endswith(SENTENCE_ENDS) and end > 0 and answer_correct(answer[: end + 1], gold):
        return answer[: end + 1]
    return answer


def teacher_answers(model: NuggetModel, records: Sequence[dict], batch_size: int,
                    max_new_tokens: int) -> Iterator[tuple[dict, str]]:
    """(record, Full's answer) for every record, in batches of similar prompt length."""
    tok = model.tokenizer
    prompts = [chat_token_ids(tok, full_context_messages([r["context"]], render_instruction(QA_PROMPT, r["question"])))
               for r in records]
    order = sorted(range(len(records)), key=lambda i: len(prompts[i]))
    settings = GenerationSettings(max_new_tokens=max_new_tokens)
    for start in tqdm(range(0, len(order), batch_size), desc="teacher answers"):
        chunk = order[start : start + batch_size]
        texts = generate(model, [[] for _ in chunk], [prompts[i] for i in chunk], settings, adapter=None)
        yield from ((records[i], text) for i, text in zip(chunk, texts))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--squad", required=True, help="SQuAD v1.1 JSON (its splits.json decides the split)")
    p.add_argument("--split", default="train", choices=["train", "dev"])
    p.add_argument("--n", type=int, default=None, help="questions to answer, drawn at random (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--base-model", default=None, help="base model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    records = corpora.read_squad(args.squad, args.split)
    random.Random(args.seed).shuffle(records)
    records = records[: args.n]
    asked = _ids(args.out, lambda line: json.loads(line)["id"]) | _ids(_rejected(args.out), lambda line: line.split("\t")[0])
    todo = [r for r in records if r["id"] not in asked]
    model = NuggetModel.from_pretrained(None, base_model=args.base_model).eval()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    with args.out.open("a") as out, _rejected(args.out).open("a") as rejected:
        for record, text in teacher_answers(model, todo, args.batch_size, args.max_new_tokens):
            answer = kept_answer(text, record["answers"])
            if answer is None:
                rejected.write(f"{record['id']}\t{json.dumps(text)}\n")
                continue
            kept += 1
            out.write(json.dumps({"id": record["id"], "context": record["context"], "question": record["question"],
                                  "answers": [answer], "gold": record["answers"]}) + "\n")
    log.info("%d of %d new answers contain a gold answer; %d questions were answered before", kept, len(todo),
             len(asked))


def _ids(path: Path, read) -> set[str]:
    return {read(line) for line in path.read_text().splitlines() if line.strip()} if path.is_file() else set()


def _rejected(out: Path) -> Path:
    """Questions whose answer was not kept (id, answer), so that a re-run does not ask them again."""
    return out.with_suffix(".rejected.tsv")


if __name__ == "__main__":
    main()

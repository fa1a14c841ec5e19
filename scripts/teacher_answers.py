"""Sequence-level distillation data for QA fine-tuning: the frozen base model's own answers to SQuAD questions.

    python scripts/teacher_answers.py --squad ../shared/data/squad-dev-v1.1.json --split train --n 1400 \\
        --out runs/kd/squad-teacher.jsonl

Each answer is Full's (the eval harness's reference): the passage as text in the prompt, greedy, at most 64 new
tokens, adapters off. Only answers that contain a gold answer (App. E normalisation) are kept; one cut off by the
token limit is kept only as its longest run of whole sentences that still contains a gold answer. The output is a
QA JSONL file (`id`, `context`, `question`, `answers`: the teacher's answer, the training target, then the gold
answers, which the trainer's dev accuracy scores against) that trains as `--data qa:<file>` (docs/experiments/2026-11-23-training-diary.md, "Stage 2
on distilled answers"). The trainer holds out every 20th line as dev; questions on one passage can fall on both
sides, so that dev loss only monitors training (score on SQuAD's dev articles). Questions not kept go to
`<out>.rejected.jsonl` with the reason. Re-running with the same settings asks only the questions not yet asked.
`--skip N` leaves out the draw's first N questions, so that a run growing a file from `--n N` to `--n M` can be done
by two processes side by side: `--n N` and `--n M --skip N`, their files (and `.rejected.jsonl`) concatenated, are
the file of `--n N` followed by a re-run with `--n M` (the answers are written batched by length within each run).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from nugget_rag import corpora
from nugget_rag.eval.metrics import answer_correct
from nugget_rag.generation import GenerationSettings
from nugget_rag.model import NuggetModel
from nugget_rag.prompts import QA_PROMPT, render_instruction
from nugget_rag.train.teacher_data import done_ids, full_context_outputs, rejected_path

log = logging.getLogger("teacher_answers")
# a sentence's end: . ! ? (and a closing quote or bracket) after a lower-case letter or a closing mark, so that
# list numbers ("1. "), initials and "U.S." do not end one
SENTENCE_END = re.compile(r"(?<=[a-z%)\]\"'])[.!?][\"')\]]?(?=\s|$)")


def kept_answer(answer: str, gold: Sequence[str], truncated: bool) -> str | None:
    """The answer to train on, or None: it contains no gold answer, or it was cut off by the token limit and no
    whole sentences of it contain one (the decoder must not learn to stop mid-sentence)."""
    answer = answer.strip()
    if not answer_correct(answer, gold):
        return None
    if not truncated:
        return answer
    ends = [m.end() for m in SENTENCE_END.finditer(answer)]
    return next((answer[:end] for end in reversed(ends) if answer_correct(answer[:end], gold)), None)


def teacher_answers(model: NuggetModel, records: Sequence[dict], batch_size: int,
                    max_new_tokens: int) -> Iterator[tuple[dict, str, bool]]:
    """(record, Full's answer, whether the token limit cut it off) for every record, batched by prompt length."""
    readings = [([r["context"]], render_instruction(QA_PROMPT, r["question"])) for r in records]
    settings = GenerationSettings(max_new_tokens=max_new_tokens)
    for i, text, truncated in full_context_outputs(model, readings, settings, batch_size, desc="teacher answers"):
        yield records[i], text, truncated


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--squad", required=True, help="SQuAD v1.1 JSON (its splits.json decides the split)")
    p.add_argument("--split", default="train", choices=["train", "dev"])
    p.add_argument("--n", type=int, default=None, help="questions to answer, drawn at random (default: all)")
    p.add_argument("--skip", type=int, default=0, help="leave out the draw's first SKIP questions (another "
                   "process answers them)")
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
    if not 0 <= args.skip < (args.n or len(records)):
        p.error(f"--skip {args.skip} leaves no question of the {args.n or len(records)} drawn; use 0 <= SKIP < N")
    records = records[args.skip : args.n]
    asked = done_ids(args.out)
    todo = [r for r in records if r["id"] not in asked]
    model = NuggetModel.from_pretrained(None, base_model=args.base_model).eval()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    counts: Counter[str] = Counter()
    with args.out.open("a", buffering=1) as out, rejected_path(args.out).open("a", buffering=1) as rejected:
        for record, text, truncated in teacher_answers(model, todo, args.batch_size, args.max_new_tokens):
            answer = kept_answer(text, record["answers"], truncated)
            if answer is None:
                reason = "no gold answer" if not answer_correct(text, record["answers"]) else "cut off"
                counts[reason] += 1
                rejected.write(json.dumps({"id": record["id"], "reason": reason, "answer": text}) + "\n")
                continue
            counts["kept, cut back to whole sentences" if truncated else "kept"] += 1
            # answers[0] is the training target; the gold answers stay references for the trainer's dev accuracy
            out.write(json.dumps({"id": record["id"], "context": record["context"], "question": record["question"],
                                  "answers": [answer, *record["answers"]]}) + "\n")
    log.info("%d new questions: %s; %d were answered before", len(todo), dict(counts), len(asked))


if __name__ == "__main__":
    main()

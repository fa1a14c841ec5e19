"""Sequence-level distillation data: the frozen model's own outputs as training targets (scripts/teacher_answers.py,
scripts/teacher_summaries.py).

The teacher is Full, the eval harness's reference: the base model with its adapters off, reading the documents as
text in the uncompressed prompt (`prompts.full_context_messages`). Its outputs are written to a JSONL file a line a
record, and the records not kept to `<out>.rejected.jsonl` with the reason, so that a re-run (after a kill, or with
a larger draw) asks only what neither file holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from ..generation import GenerationSettings, generate
from ..model import NuggetModel
from ..prompts import chat_token_ids, full_context_messages


def full_context_outputs(model: NuggetModel, readings: Sequence[tuple[Sequence[str], str]],
                         settings: GenerationSettings, batch_size: int,
                         desc: str = "teacher") -> Iterator[tuple[int, str, bool]]:
    """(index into `readings`, Full's output, whether the token limit cut it off) for each (documents,
    instruction), in batches of prompts of about one length (the shortest first), with a progress bar."""
    tok = model.tokenizer
    prompts = [chat_token_ids(tok, full_context_messages(list(documents), instruction))
               for documents, instruction in readings]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in tqdm(range(0, len(order), batch_size), desc=desc):
        chunk = order[start : start + batch_size]
        texts = generate(model, [[] for _ in chunk], [prompts[i] for i in chunk], settings, adapter=None)
        for i, text in zip(chunk, texts):
            # re-tokenising may merge a token or two, hence the margin
            yield i, text, len(tok(text, add_special_tokens=False)["input_ids"]) >= settings.max_new_tokens - 2


def written_ids(path: Path) -> set[str]:
    """Record ids already in a JSONL file, after dropping a last line left half-written by a killed run."""
    if not path.is_file():
        return set()
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text)
    return {json.loads(line)["id"] for line in text.splitlines() if line.strip()}


def rejected_path(out: Path) -> Path:
    """Where the records not kept go (JSONL: id, reason, the output), so that a re-run does not ask them again."""
    return out.with_suffix(".rejected.jsonl")


def done_ids(out: Path) -> set[str]:
    """Ids a teacher run into `out` has already asked: kept or rejected."""
    return written_ids(out) | written_ids(rejected_path(out))

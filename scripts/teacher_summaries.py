"""Sequence-level distillation data for summaries: the frozen base model's own one-sentence summaries of the
sections the summary chain reads.

    python scripts/teacher_summaries.py --cnndm ../shared/data/cnndm-test-250.jsonl \\
        --corpus ../corpus/train-013.jsonl --n-corpus 1000 --out ../runs/summ-teacher/teacher-summaries.jsonl --threads 1

The summary chain (integrations/retrieval/summary_chain.py, NuggetSummarizer) cuts a text into sections of at most
512 tokens (`cut_sections`); its default reading, "outline", has the decoder write a sentence a section from the
section's nuggets: SUMMARY_PROMPT, greedy, at most `section_max_new_tokens` (32) new tokens and then up to
FINISH_SENTENCE (32) more to end the sentence the limit cut, stopping at a line break, the first sentence kept
(`first_sentence`). This writes the targets of that reading: Full's (the eval harness's reference: the section as
text in the prompt, adapters off) output with the same prompt and the same budget, greedy, stopping at a line break;
its first sentence is the target. (The finishing tokens matter: at a hard 32 the base model's first sentence was
cut in both sections of a first dry run.) An output is rejected when it is empty, when its first sentence does not end within
the budget, when that sentence is a fragment of fewer than MIN_WORDS words (a cut at "U.S."), or when it loops
(`degenerate`). A word 3-gram said twice is kept ("has become a ... has become a"): the chain's decode bars it
(no_repeat_ngram_size 3) and writes another word there, but the rest of the sentence still teaches the reading.

Sections come from CNN/DailyMail's train articles (`--cnndm`: the train part of splits.json only; every section of
each article, `--n-cnndm` articles of a seeded draw, default all) and from corpus documents (`--corpus`, JSONL with a
`text` field: its train part; `--n-corpus` sections, one of each document of a seeded draw of its documents). The
output is JSONL: `id` (`cnndm:<index among the train articles>:<section index>`, `corpus:<index among the train
documents>:<section index>`), `source`, `document` (the section's text) and `summary` (the target). It trains as the
`summarization` objective with `document_field: document, summary_field: summary`; `documents_per_example: 3`
composes digests of three sections (train/objectives.py). The trainer holds out every 20th line as dev (no
splits.json names the file); sections of one article can fall on both sides, so that dev loss only monitors
training. Sections not kept go to `<out>.rejected.jsonl` with the reason; re-running with the same settings reads
only the sections that neither file holds.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from langchain_core.documents import Document
from transformers import PreTrainedTokenizerBase

from nugget_rag import corpora
from nugget_rag.generation import GenerationSettings
from nugget_rag.generation.text import ends_sentence, first_repeat, words
from nugget_rag.integrations.retrieval.summary_chain import (
    FINISH_SENTENCE,
    NuggetSummarizer,
    cut_sections,
    first_sentence,
)
from nugget_rag.model import NuggetModel
from nugget_rag.prompts import SUMMARY_PROMPT
from nugget_rag.train.teacher_data import done_ids, full_context_outputs, rejected_path

log = logging.getLogger("teacher_summaries")
_CHAIN = NuggetSummarizer.model_fields  # the summary chain's defaults: what the targets are read with
SECTION_TOKENS = _CHAIN["section_tokens"].default
MAX_NEW_TOKENS = _CHAIN["section_max_new_tokens"].default
MIN_WORDS = 4
LOOP_WORDS = 6  # a run of this many words said twice is a loop
SPLIT = "train"  # the only part read: CNN/DM's dev and test articles score the summaries


def kept_summary(text: str) -> tuple[str | None, str]:
    """(the target: `text`'s first sentence, as the summary chain keeps it, '') or (None, why it is not kept)."""
    sentence = first_sentence(text)
    if not sentence:
        return None, "empty"
    if not ends_sentence(sentence):
        return None, "no sentence end"
    tokens = words(sentence)
    if len(tokens) < MIN_WORDS:
        return None, "fragment"
    if degenerate(tokens):
        return None, "repetition"
    return sentence, ""


def degenerate(tokens: Sequence[str]) -> bool:
    """Whether words loop: a run of LOOP_WORDS words said twice, or a 3-gram said three times."""
    grams = Counter(zip(tokens, tokens[1:], tokens[2:]))
    return first_repeat(tokens, LOOP_WORDS) is not None or any(n >= 3 for n in grams.values())


def sections(tokenizer: PreTrainedTokenizerBase, text: str, section_tokens: int = SECTION_TOKENS) -> list[str]:
    """The texts of the sections the summary chain cuts `text` into."""
    return [s.page_content for s in cut_sections(tokenizer, [Document(page_content=text)], section_tokens)]


def cnndm_sections(tokenizer: PreTrainedTokenizerBase, path: Path, n: int | None, seed: int,
                   split: str = SPLIT, section_tokens: int = SECTION_TOKENS) -> list[dict]:
    """Every section of `n` CNN/DM articles of the train part (a seeded draw; None: all), as records."""
    if split != SPLIT:
        raise ValueError(f"split {split!r}: teacher summaries are made of the {SPLIT} part only (the dev and test "
                         "articles score the summaries)")
    articles = list(enumerate(corpora.read_summarization(path, split)))
    random.Random(seed).shuffle(articles)
    return [section_record("cnndm", i, j, text) for i, article in articles[:n]
            for j, text in enumerate(sections(tokenizer, article["document"], section_tokens))]


def corpus_sections(tokenizer: PreTrainedTokenizerBase, path: Path, n: int, seed: int, text_field: str = "text",
                    section_tokens: int = SECTION_TOKENS) -> list[dict]:
    """`n` sections of the corpus's train part: one of each document of a seeded draw, chosen by the document's own
    seed (so that a larger `n` keeps the smaller one's sections)."""
    if n <= 0:
        return []
    documents = list(enumerate(corpora.read_documents(path, SPLIT, text_field)))
    random.Random(seed).shuffle(documents)
    chosen = []
    for i, document in documents:
        texts = sections(tokenizer, document["text"], section_tokens)
        if texts:
            j = random.Random(f"{seed}:{i}").randrange(len(texts))
            chosen.append(section_record("corpus", i, j, texts[j]))
        if len(chosen) == n:
            break
    return chosen


def section_record(source: str, index: int, section: int, text: str) -> dict:
    return {"id": f"{source}:{index}:{section}", "source": source, "document": text}


def teacher_summaries(model: NuggetModel, records: Sequence[dict], batch_size: int,
                      max_new_tokens: int = MAX_NEW_TOKENS) -> Iterator[tuple[dict, str]]:
    """(record, Full's output for the section: greedy, `max_new_tokens` and then up to FINISH_SENTENCE more to end
    the sentence they cut, as the summary chain decodes a section, stopped at a line break) for every record,
    batched by prompt length."""
    readings = [([r["document"]], SUMMARY_PROMPT) for r in records]
    settings = GenerationSettings(max_new_tokens=max_new_tokens, finish_sentence=FINISH_SENTENCE, stop=["\n"])
    for i, text, _ in full_context_outputs(model, readings, settings, batch_size, desc="teacher summaries"):
        yield records[i], text


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cnndm", type=Path, default=None, help="CNN/DM JSONL (its splits.json decides the train part)")
    p.add_argument("--n-cnndm", type=int, default=None, help="CNN/DM train articles, drawn at random (default: all)")
    p.add_argument("--corpus", type=Path, default=None, help="corpus JSONL (a text field a line), e.g. a train shard")
    p.add_argument("--n-corpus", type=int, default=0, help="corpus sections, one a document of a random draw")
    p.add_argument("--text-field", default="text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--base-model", default=None, help="base model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                   help="the summary chain's section_max_new_tokens")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.cnndm is None and not (args.corpus and args.n_corpus):
        p.error("nothing to summarise: give --cnndm, or --corpus with --n-corpus N")
    if args.n_corpus and args.corpus is None:
        p.error("--n-corpus needs --corpus")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = NuggetModel.from_pretrained(None, base_model=args.base_model).eval()
    records = []
    if args.cnndm is not None:
        records += cnndm_sections(model.tokenizer, args.cnndm, args.n_cnndm, args.seed)
    if args.corpus is not None:
        records += corpus_sections(model.tokenizer, args.corpus, args.n_corpus, args.seed, args.text_field)
    asked = done_ids(args.out)
    todo = [r for r in records if r["id"] not in asked]
    log.info("%d sections (%s), %d to summarise", len(records), dict(Counter(r["source"] for r in records)), len(todo))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    counts: Counter[str] = Counter()
    with args.out.open("a", buffering=1) as out, rejected_path(args.out).open("a", buffering=1) as rejected:
        for record, text in teacher_summaries(model, todo, args.batch_size, args.max_new_tokens):
            summary, reason = kept_summary(text)
            counts[reason or "kept"] += 1
            if summary is None:
                rejected.write(json.dumps({"id": record["id"], "reason": reason, "output": text}) + "\n")
                continue
            out.write(json.dumps({**record, "summary": summary}) + "\n")
    log.info("%d new sections: %s; %d were summarised before", len(todo), dict(counts), len(asked))


if __name__ == "__main__":
    main()

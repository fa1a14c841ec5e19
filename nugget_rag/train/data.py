"""Training examples: records (records.py) -> tokenised examples of one objective -> a resumable stream of them
(batches.py draws micro-batches from the streams).

An example is a dict with
- ``documents``: token ids of each document to compress (independently; composed in order by the decoder),
- ``prefix``: the decoder's tokens before the nuggets (the chat template's opening under
  `NuggetConfig.placement="in_user_turn"`, else none),
- ``input_ids``: the decoder's tokens after the nuggets, ``target_start``: the first of them that is a target,
- ``references``: texts a generated output is scored against at evaluation (may be empty),
- ``skip``: '' for a real example, else why its record was skipped (counted, then dropped).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import datasets
except ImportError as err:  # a core install: training is an extra
    raise ImportError("datasets is not installed: nugget-rag's training needs its [train] extra "
                      "(pip install 'nugget-rag[train]')") from err
from transformers import PreTrainedTokenizerBase

from .. import corpora
from ..config import nugget_count
from ..model.identity import tokenizer_digest
from ..model.layout import document_opening, prompt_around_documents
from ..prompts import (
    chat_token_ids,
    full_context_messages,
)
from .objectives import OBJECTIVES, example, skip
from .records import load_records
from .sources import Lengths, Source

log = logging.getLogger(__name__)

BATCH_RECORDS = 256  # records per builder call: an example's distractors and random draws come from its batch
PARALLEL_RECORDS = 1000  # records per tokenising process, at least
MAX_PROCESSES = 16
COLUMNS = ["documents", "prefix", "input_ids", "target_start", "references", "readings", "teacher_documents", "skip"]


class ExampleBuilder:
    """Turns records of one source into tokenised examples (a batched `datasets.map` function): the objectives'
    Builder (objectives.py)."""

    def __init__(self, source: Source, tokenizer: PreTrainedTokenizerBase, lengths: Lengths, max_positions: int,
                 ratio: float, seed: int, in_user_turn: bool, teacher_positions: int | None = None,
                 original_positions: bool = False):
        """`ratio`: the smallest the run trains with (the most nuggets); `teacher_positions`: with distillation, the
        teacher's positions (an example whose full text does not fit them is skipped); `original_positions`: the
        decoder places nuggets at their documents' positions (`NuggetConfig.nugget_positions`)."""
        self.source, self.tok, self.lengths, self.seed = source, tokenizer, lengths, seed
        self.original_positions = original_positions
        self.max_positions, self.ratio, self.in_user_turn = max_positions, ratio, in_user_turn
        self.teacher_positions = None if source.full_context else teacher_positions
        self.opening = document_opening(tokenizer, in_user_turn)  # NuggetModel.document_opening
        self.objective = OBJECTIVES[source.objective]
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.tokenizer_digest = tokenizer_digest(tokenizer)
        self._check_lengths()

    def _check_lengths(self) -> None:
        L, r = self.lengths, self.ratio
        need = L.document + L.answer + 64 if self.source.full_context else len(self.opening) + self.objective.positions(self)
        if need > self.max_positions:
            raise ValueError(
                f"lengths {L.model_dump()} at ratio {r} need {need} decoder positions for {self.source.objective}, "
                f"more than the model's {self.max_positions}; lower lengths.document/answer/query/autoencoding"
            )

    def settings(self) -> dict:
        """Everything that shapes the examples, portably: the tokenizer by its digest, data files by their names."""
        source = self.source.model_dump(mode="json", exclude={"weight", "streaming"})
        source.update({k: Path(source[k]).name for k in ("path", "dev_path") if source[k]})
        return {"source": source, "lengths": self.lengths.model_dump(), "ratio": self.ratio,
                "max_positions": self.max_positions, "seed": self.seed, "tokenizer": self.tokenizer_digest,
                "in_user_turn": self.in_user_turn, "teacher_positions": self.teacher_positions,
                "original_positions": self.original_positions, "version": 4}

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.settings(), sort_keys=True).encode()).hexdigest()[:16]

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out = {c: [] for c in COLUMNS}
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        rng = random.Random(f"{self.seed}-{indices[0] if indices else 0}")
        for row in rows:
            try:
                examples = self.objective.build(self, row, rows, rng)
            except KeyError as err:
                examples = [skip(f"missing field {err}")]
            if self.teacher_positions is not None:
                examples = [skip("teacher input longer than its positions")
                            if not e["skip"] and teacher_length(e) > self.teacher_positions else e for e in examples]
            for ex in examples:
                for c in COLUMNS:
                    out[c].append(ex[c])
        return out

    def state_positions(self, document_lengths: list[int], readings: list[float] | None = None) -> int:
        """Decoder positions the nuggets of documents of these lengths take (layout.compose), at the run's smallest
        ratio or at each document's own."""
        if self.original_positions:
            return sum(document_lengths)
        ratios = readings or [self.ratio] * len(document_lengths)
        return sum(nugget_count(n, r) for n, r in zip(document_lengths, ratios))

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def task(self, documents: list[str], instruction: str, answer: str, references: list[str],
              extractive: bool = False, readings: list[float] | None = None,
              teacher_documents: list[str] | None = None) -> dict:
        """A (documents, prompt, answer) triple in NuggetLLM's prompt format; the loss covers the answer only.

        Documents are cut to `lengths.document` tokens; an extractive answer that the cut removed skips the
        example. An answer cut to `lengths.answer` tokens gets no EOS (it does not end there). `readings`: each
        document's own ratio (example()); `teacher_documents`: what the teacher reads instead."""
        L = self.lengths
        full_ids = [self.ids(d) for d in documents]
        if readings is not None and any(not d for d in full_ids):
            return skip("empty document")
        doc_ids = [d[: L.document] for d in full_ids if d]
        if not doc_ids or sum(map(len, doc_ids)) < L.min_document:
            return skip("empty document")
        if extractive and any(len(d) > L.document for d in full_ids):
            kept = " ".join(self.tok.decode(d) for d in doc_ids)
            if not any(str(a).strip() in kept for a in references):
                return skip("answer cut off with the document")
        answer_ids = self.ids(answer.strip())
        answer_ids = answer_ids[: L.answer] + (self.eos if len(answer_ids) <= L.answer else [])
        if self.source.full_context:
            texts = [self.tok.decode(d) for d in doc_ids]
            prefix, prompt = [], chat_token_ids(self.tok, full_context_messages(texts, instruction))
            doc_ids = []
        else:
            prefix, prompt = prompt_around_documents(self.tok, [{"role": "user", "content": instruction}],
                                                     self.in_user_turn)
        positions = self.state_positions([len(d) for d in doc_ids], readings if doc_ids else None)
        if len(prefix) + positions + len(prompt) + len(answer_ids) > self.max_positions:
            return skip("too long for the model's positions")
        teacher = [self.ids(d)[: L.document] for d in teacher_documents or []]
        return example(doc_ids, prompt + answer_ids, len(prompt), references, prefix,
                       readings if doc_ids else None, teacher)


def teacher_length(example: dict) -> int:
    """Tokens of an example's uncompressed (teacher) input: prefix, every document's tokens, the decoder's tokens."""
    documents = example.get("teacher_documents") or example["documents"]
    return len(example["prefix"]) + sum(len(d) for d in documents) + len(example["input_ids"])


def build_examples(source: Source, split: str | None, builder: ExampleBuilder, cache_dir: Path | None,
                   processes: int | None = None):
    """Tokenised examples of a source's split, and the skip counts (None for a stream: counted as it goes).

    With a `cache_dir`, a split of at least 2 * PARALLEL_RECORDS records is tokenised in several processes (one per
    CPU core, at most MAX_PROCESSES; `processes` sets their number), giving the examples one process gives."""
    records = load_records(source, split)
    first = next(iter(records.take(1) if isinstance(records, datasets.IterableDataset) else records.select(range(min(1, len(records))))), None)
    if first is None:
        hint = " (set dev_split=None to train without evaluating it)" if split == source.dev_split else ""
        raise corpora.DataError(f"source {source.path} has no records in split {split!r}{hint}")
    _check_fields(source, first)
    kwargs = dict(batched=True, batch_size=BATCH_RECORDS, with_indices=True, remove_columns=list(first))
    if isinstance(records, datasets.IterableDataset):
        return records.map(builder, **kwargs), None
    cache = None
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cache = str(cache_dir / f"{builder.fingerprint()}-{split}-{records._fingerprint}.arrow")
    procs = processes or min(os.cpu_count() or 1, MAX_PROCESSES, len(records) // PARALLEL_RECORDS)
    if cache is not None and procs > 1:
        examples = _map_in_processes(records, builder, cache, procs, kwargs)
    else:
        examples = records.map(builder, cache_file_name=cache, desc=f"tokenising {Path(source.path).name}", **kwargs)
    skipped = Counter(s for s in examples["skip"] if s)
    if skipped:
        examples = examples.filter(lambda s: not s, input_columns="skip")
    if len(examples) == 0:
        raise corpora.DataError(f"source {source.path} (split {split}) gives no usable example: skipped {dict(skipped)}")
    return examples, skipped


def _map_in_processes(records: datasets.Dataset, builder: ExampleBuilder, cache: str, procs: int,
                      kwargs: dict) -> datasets.Dataset:
    """`records.map(builder)` in forked processes, each on a run of whole batches (the batch is what an example's
    distractors and random draws come from), each writing its part of the Arrow cache; one process if one fails."""
    blocks = -(-len(records) // BATCH_RECORDS)
    cuts = sorted({min(len(records), round(blocks * k / procs) * BATCH_RECORDS) for k in range(procs + 1)})

    def part(k: int) -> datasets.Dataset:
        start, end = cuts[k], cuts[k + 1]
        shifted = _Shifted(builder, start)
        return records.select(range(start, end)).map(shifted, cache_file_name=f"{cache[:-6]}-{k}of{len(cuts) - 1}.arrow",
                                                     **kwargs)

    fork = multiprocessing.get_context("fork")
    workers = [fork.Process(target=part, args=(k,)) for k in range(len(cuts) - 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if any(worker.exitcode for worker in workers):
        log.warning("tokenising in %d processes failed (exit codes %s); tokenising in one", len(workers),
                    [worker.exitcode for worker in workers])
        return records.map(builder, cache_file_name=cache, **kwargs)
    return datasets.concatenate_datasets([part(k) for k in range(len(cuts) - 1)])  # each read from its cache file


@dataclass
class _Shifted:
    """A builder for records from `offset` on (its indices are counted from there)."""

    builder: ExampleBuilder
    offset: int

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        return self.builder(batch, [i + self.offset for i in indices])


def _check_fields(source: Source, record: dict) -> None:
    needs = OBJECTIVES[source.objective].fields(source)
    for need in needs:
        options = (need,) if isinstance(need, str) else need
        if not any(o in record for o in options):
            raise corpora.DataError(
                f"source {source.path}: records lack the field {options[-1]!r} that {source.objective} needs "
                f"(they have {sorted(record)}); set the matching *_field option"
            )


# ------------------------------------------------------------------ streams
class ExampleStream:
    """An endless, deterministic, resumable stream of one source's examples (reshuffled every epoch)."""

    def __init__(self, examples, seed: int):
        self.examples, self.seed = examples, seed
        self.epoch, self.position = 0, 0
        self.skipped: Counter = Counter()
        self._iterator: Iterator | None = None
        self._order: np.ndarray | None = None

    @property
    def streaming(self) -> bool:
        return isinstance(self.examples, datasets.IterableDataset)

    def take(self, count: int) -> list[dict]:
        return [self._next() for _ in range(count)]

    def _next(self) -> dict:
        if self.streaming:
            return self._next_streamed()
        if self._order is None:
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.examples))
        if self.position == len(self._order):
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
            return self._next()
        example = self.examples[int(self._order[self.position])]
        self.position += 1
        return example

    def _next_streamed(self) -> dict:
        for _ in range(1_000_000):
            if self._iterator is None:
                shuffled = self.examples.shuffle(seed=self.seed, buffer_size=1000)
                shuffled.set_epoch(self.epoch)
                self._iterator = iter(shuffled.skip(self.position))
            example = next(self._iterator, None)
            if example is None:
                if self.position == 0:
                    raise corpora.DataError("a streamed source gave no example")
                self.epoch, self.position, self._iterator = self.epoch + 1, 0, None
                continue
            self.position += 1
            if example["skip"]:
                self.skipped[example["skip"]] += 1
                continue
            return example
        raise corpora.DataError("a streamed source skipped every record")

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "skipped": dict(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.skipped = Counter(state.get("skipped", {}))
        self._iterator = self._order = None


"""Training data: records from files (through `datasets`) -> tokenised examples of one objective -> batches.

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
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

try:
    import datasets
except ImportError as err:  # a core install: training is an extra
    raise ImportError("datasets is not installed: nugget-rag's training needs its [train] extra "
                      "(pip install 'nugget-rag[train]')") from err
import torch
from transformers import PreTrainedTokenizerBase

from .. import corpora
from ..config import nugget_count
from ..model.identity import tokenizer_digest
from ..model.layout import document_opening, prompt_around_documents
from ..model.packing import first_fit
from ..prompts import (
    chat_token_ids,
    full_context_messages,
)
from .objectives import OBJECTIVES, example, skip
from .sources import Lengths, Source

log = logging.getLogger(__name__)

BATCH_RECORDS = 256  # records per builder call: an example's distractors and random draws come from its batch
PARALLEL_RECORDS = 1000  # records per tokenising process, at least
MAX_PROCESSES = 16
COLUMNS = ["documents", "prefix", "input_ids", "target_start", "references", "readings", "teacher_documents", "skip"]
_SUFFIX_FORMATS = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".txt": "text",
                   ".text": "text", ".md": "text", ".rst": "text"}
_BUILDERS = {"json": "json", "jsonl": "json", "parquet": "parquet", "text": "text"}


# ------------------------------------------------------------------ records
def resolve_format(source: Source) -> str:
    if source.format != "auto":
        return source.format
    path = Path(source.path)
    if not path.exists():
        raise corpora.DataError(f"data path {source.path} not found (for a hub data set, set format='hub')")
    files = _files(path, None)
    suffixes = {f.suffix.lower() for f in files}
    formats = {_SUFFIX_FORMATS.get(s) for s in suffixes}
    if len(formats) != 1 or None in formats:
        raise corpora.DataError(f"cannot tell the format of {source.path} (suffixes {sorted(suffixes)}); set format=")
    fmt = formats.pop()
    if fmt == "json" and path.is_file():
        head = path.open(encoding="utf-8").read(4096).lstrip()
        if head.startswith("{") and '"data"' in head[:200] and '"paragraphs"' in head:
            return "squad"
        if head.startswith("[") and '"supporting_facts"' in head:
            return "hotpotqa"
    return fmt


def _files(path: Path, fmt: str | None) -> list[Path]:
    if path.is_file():
        return [path]
    suffixes = [s for s, f in _SUFFIX_FORMATS.items() if fmt is None or f == fmt or (fmt == "json" and f == "jsonl")]
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
    if not files:
        raise corpora.DataError(f"{path} holds no data files ({', '.join(suffixes)})")
    return files


def _splits_entry(path: Path) -> dict | None:
    """The splits.json entry of a file (as in ../shared/data), or None."""
    table = path.parent / corpora.SPLITS_FILE
    if not (path.is_file() and table.is_file()):
        return None
    return json.loads(table.read_text()).get(path.name)


def _guard_test_part(source: Source, fmt: str, split: str | None, entry: dict | None) -> None:
    """A file whose splits.json `entry` names a test part is read only by part, and in the units those parts
    count; a folder holding such a file is refused."""
    path = Path(source.path)
    if path.is_dir():
        held = [f.name for f in _files(path, fmt) if (_splits_entry(f) or {}).get("test") is not None]
        if held:
            raise corpora.DataError(f"{path} holds {', '.join(held)}, which {corpora.SPLITS_FILE} gives a test part; "
                                    "name each file as its own source, so that only its part is read")
        return
    if entry is None or entry.get("test") is None:
        return
    native = resolve_format(source.model_copy(update={"format": "auto"}))
    if fmt != native and {"squad", "hotpotqa"} & {fmt, native}:  # their readers count other units than lines
        raise corpora.DataError(f"{path.name} is split by {corpora.SPLITS_FILE} in units of its {native} format; read "
                                f"it with format=auto, not format={fmt}, so that its test part stays out")
    if split is None:
        raise corpora.DataError(f"split=None would read all of {path.name}, its test part included; use split='train'")


def load_records(source: Source, split: str | None) -> datasets.Dataset | datasets.IterableDataset:
    """The raw records of `split` of a source, in one schema per objective (see `corpora`)."""
    fmt = resolve_format(source)
    path = Path(source.path)
    entry = _splits_entry(path) if fmt != "hub" else None
    if fmt != "hub":
        _guard_test_part(source, fmt, split, entry)
    if fmt == "squad":
        return datasets.Dataset.from_list(corpora.read_squad(path, split))
    if fmt == "hotpotqa":
        return datasets.Dataset.from_list(corpora.read_hotpotqa(path, split))
    if entry is not None:  # a file of ../shared/data: its splits.json decides
        if source.objective == "summarization":
            records = corpora.read_summarization(path, split, source.document_field, source.summary_field)
        else:
            records = corpora.read_documents(path, split, source.text_field)
        return datasets.Dataset.from_list(records)
    if fmt == "hub":
        data = datasets.load_dataset(source.path, split=split or "train", streaming=source.streaming)
    else:
        files = [str(f) for f in _files(path, fmt)]
        data = datasets.load_dataset(_BUILDERS[fmt], data_files=files, split="train", streaming=source.streaming)
        if split is not None:
            keep = corpora.split_filter(path, split)
            data = data.filter(lambda _, i: keep(i, 0), with_indices=True)
    return data


# ------------------------------------------------------------------ examples
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


# ------------------------------------------------------------------ sampling
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


@dataclass
class Batch:
    """One micro-batch of a single source, padded for the model."""

    source: int
    documents: list[list[list[int]]]
    input_ids: torch.Tensor
    token_mask: torch.Tensor
    labels: torch.Tensor
    references: list[list[str]]
    target_starts: list[int]
    prefixes: list[list[int]]
    ratio: float | None = None  # the compression ratio of this micro-batch (None: the model's)
    readings: list[list[float]] = field(default_factory=list)  # per example, each document's own ratio ([]: ratio)
    teacher_documents: list[list[list[int]]] = field(default_factory=list)  # per example ([]: its documents)

    @property
    def tokens(self) -> int:
        """Tokens the step reads: the documents' and the decoder's."""
        return sum(len(d) for docs in self.documents for d in docs) + int(self.token_mask.sum())

    @property
    def padded_tokens(self) -> int:
        """Tokens the passes compute, padding included: the documents in one encoder batch, then the decoder's."""
        lengths = [len(d) for docs in self.documents for d in docs]
        return len(lengths) * max(lengths, default=0) + self.token_mask.numel()

    @property
    def packed_tokens(self) -> int:
        """`padded_tokens` with the documents packed (TrainConfig.packing): several to a row of the longest's width
        (packing.first_fit)."""
        lengths = [len(d) for docs in self.documents for d in docs]
        rows = len({row for row, _ in first_fit(lengths, max(lengths))}) if lengths else 0
        return rows * max(lengths, default=0) + self.token_mask.numel()

    @property
    def targets(self) -> int:
        """Labelled tokens: what the loss averages over."""
        return int((self.labels != -100).sum())

    def split(self, parts: int) -> list[Batch]:
        """The examples in `parts` smaller batches, in order, each cut to its own longest example."""
        size = -(-len(self.documents) // parts)
        pieces = []
        for start in range(0, len(self.documents), size):
            rows = slice(start, start + size)
            width = int(self.token_mask[rows].sum(1).max())
            pieces.append(replace(self, documents=self.documents[rows], input_ids=self.input_ids[rows, :width],
                                  token_mask=self.token_mask[rows, :width], labels=self.labels[rows, :width],
                                  references=self.references[rows], target_starts=self.target_starts[rows],
                                  prefixes=self.prefixes[rows], readings=self.readings[rows],
                                  teacher_documents=self.teacher_documents[rows]))
        return pieces


def collate(examples: list[dict], source: int, pad_id: int) -> Batch:
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.bool)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        mask[i, :n] = True
        labels[i, e["target_start"] : n] = ids[i, e["target_start"] : n]
    return Batch(source, [e["documents"] for e in examples], ids, mask, labels,
                 [e["references"] for e in examples], [e["target_start"] for e in examples],
                 [e["prefix"] for e in examples], readings=[list(e.get("readings") or []) for e in examples],
                 teacher_documents=[list(e.get("teacher_documents") or []) for e in examples])


def example_length(example: dict) -> int:
    """Tokens an example puts through the model: its documents' and the decoder's (the length it is grouped by)."""
    return sum(len(d) for d in example["documents"]) + len(example["input_ids"])


class Mixture:
    """Batches drawn from the sources by weight; which source a micro-batch comes from depends only on (seed, draw).

    With several processes (`world`), every process draws the same `batch_size * world` examples and keeps its own
    slice, so the processes train on different examples while their data positions stay identical.

    `group_by_length` > 1 draws that many micro-batches of a source at once, sorts their examples by length, cuts
    them into micro-batches of similar lengths and serves those in a shuffled order: less padding, the same
    examples. A resumed run draws the current group again from where it began and skips what was served.
    """

    def __init__(self, streams: list[ExampleStream], weights: list[float], seed: int, batch_size: int, pad_id: int,
                 rank: int = 0, world: int = 1, group_by_length: int = 0):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not one of the {world} processes")
        self.streams, self.seed, self.batch_size, self.pad_id = streams, seed, batch_size, pad_id
        self.rank, self.world, self.group = rank, world, group_by_length
        total = sum(weights)
        self.cumulative = np.cumsum([w / total for w in weights])
        self.draws = 0
        self.groups = [_Group() for _ in streams]

    def next_batch(self) -> Batch:
        u = np.random.default_rng([self.seed, 7, self.draws]).random()
        source = min(int(np.searchsorted(self.cumulative, u, side="right")), len(self.streams) - 1)
        self.draws += 1
        examples = self._take(source) if self.group > 1 else self.streams[source].take(self.batch_size * self.world)
        return collate(examples[self.rank :: self.world], source, self.pad_id)

    def _take(self, source: int) -> list[dict]:
        group = self.groups[source]
        if group.served == len(group.batches):
            group.start, group.index, group.served = self.streams[source].state_dict(), group.index + 1, 0
            self._draw(source)
        group.served += 1
        return group.batches[group.served - 1]

    def _draw(self, source: int) -> None:
        """The source's current group: `group` micro-batches of examples of similar lengths, in a shuffled order."""
        group, size = self.groups[source], self.batch_size * self.world
        examples = sorted(self.streams[source].take(size * self.group), key=example_length)
        batches = [examples[i : i + size] for i in range(0, len(examples), size)]
        order = np.random.default_rng([self.seed, 13, source, group.index]).permutation(len(batches))
        group.batches = [batches[i] for i in order]

    def state_dict(self) -> dict:
        return {"draws": self.draws, "streams": [s.state_dict() for s in self.streams],
                "groups": [{"start": g.start, "index": g.index, "served": g.served} for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["streams"]) != len(self.streams):
            raise ValueError(f"the checkpoint has {len(state['streams'])} data sources, this run {len(self.streams)}")
        self.draws = state["draws"]
        for stream, s in zip(self.streams, state["streams"]):
            stream.load_state_dict(s)
        for source, saved in enumerate(state.get("groups", [])):
            self.groups[source] = _Group(saved["start"], saved["index"], saved["served"])
            if saved["start"] is not None:  # draw the group again from its start; the stream ends where it was
                self.streams[source].load_state_dict(saved["start"])
                self._draw(source)


@dataclass
class _Group:
    """A source's current group of micro-batches (`group_by_length`): the stream's state before it was drawn."""

    start: dict | None = None
    index: int = -1
    served: int = 0
    batches: list[list[dict]] = field(default_factory=list)

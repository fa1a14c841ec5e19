"""Batches: micro-batches of one source's examples, padded for the model, drawn from the sources by weight."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..model.packing import first_fit
from .data import ExampleStream


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

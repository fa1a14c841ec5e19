"""The encoder's sequences (document opening + document) laid out in rows for its passes: one a row, right-padded
to the longest, or packed (`TrainConfig.packing`): several a row, as many as fit in the longest's width.

A packed row attends block-diagonally: each token to the earlier tokens of its own sequence only (a boolean mask,
[rows, 1, width, width]), and every sequence's positions restart at 0. So each sequence's Scorer scores and
key/value states are those of its own right-padded row (up to the order of floating-point sums), for fewer
positions computed: padding was about half of the encoder's positions in the rag_qa stage, where documents of
very different lengths are compressed together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def first_fit(lengths: Sequence[int], width: int) -> list[tuple[int, int]]:
    """Each length's (row, start) in rows of `width`, longest first, each into the first row with room for it."""
    room: list[int] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), len(room))
        if row == len(room):
            room.append(width)
        places[i] = (row, width - room[row])
        room[row] -= lengths[i]
    return places


@dataclass
class EncoderRows:
    """Sequences in the rows of one pass. Unpacked, sequence i is row i from position 0, causal, and `unpack`,
    `gather_positions` and `per_sequence` leave tensors as they are."""

    ids: torch.Tensor  # [rows, width]
    steps: torch.Tensor | None  # [rows, width]: position ids (None: 0, 1, ... in every row)
    mask: torch.Tensor | None  # [rows, 1, width, width]: True where a token attends (None: causal)
    places: list[tuple[int, int]]  # each sequence's (row, start)
    lengths: list[int]

    @classmethod
    def of(cls, sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device | str,
           packed: bool = False) -> EncoderRows:
        lengths = [len(s) for s in sequences]
        width = max(lengths)
        places = first_fit(lengths, width) if packed else [(i, 0) for i in range(len(lengths))]
        rows = 1 + max(row for row, _ in places)
        ids = torch.full((rows, width), pad_id, dtype=torch.long)
        steps = torch.zeros((rows, width), dtype=torch.long)
        owner = torch.full((rows, width), -1, dtype=torch.long)
        for i, (sequence, (row, start)) in enumerate(zip(sequences, places)):
            span = slice(start, start + len(sequence))
            ids[row, span] = torch.tensor(list(sequence), dtype=torch.long)
            steps[row, span] = torch.arange(len(sequence))
            owner[row, span] = i
        if not packed:
            return cls(ids.to(device), None, None, places, lengths)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        # a padding token attends to itself alone (no row of the mask is empty)
        mask = (owner[:, :, None] == owner[:, None, :]) & causal | torch.eye(width, dtype=torch.bool)
        return cls(ids.to(device), steps.to(device), mask[:, None].to(device), places, lengths)

    @property
    def packed(self) -> bool:
        return self.steps is not None

    def _where(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.tensor([row for row, _ in self.places], device=device)
        starts = torch.tensor([start for _, start in self.places], device=device)
        return rows, starts

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values of the rows ([rows, width]) as [sequences, width], each sequence's from its column 0
        (past its end: whatever follows it in its row)."""
        if not self.packed:
            return values
        rows, starts = self._where(values.device)
        columns = (starts[:, None] + torch.arange(values.shape[1], device=values.device)).clamp(max=values.shape[1] - 1)
        return values[rows[:, None], columns]

    def gather_positions(self, chosen: Sequence[torch.Tensor]) -> torch.Tensor:
        """Positions within each sequence (one tensor each) as columns of the rows, [rows, most in a row], a row's
        sequences in order and padded with its last column (what CaptureNuggets gathers)."""
        if self.packed:
            per_row: dict[int, list[torch.Tensor]] = {}
            for positions, (row, start) in zip(chosen, self.places):
                per_row.setdefault(row, []).append(positions + start)
            chosen = [torch.cat(per_row[row]) for row in range(len(self.ids))]
        width = max(len(c) for c in chosen)
        return torch.stack([F.pad(c, (0, width - len(c)), value=int(c[-1])) for c in chosen])

    def per_sequence(self, states: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Captured states ([layers, rows, kv_heads, most in a row, head_dim], in `gather_positions`' order) as
        [layers, sequences, kv_heads, most, head_dim], each sequence's `counts` first."""
        if not self.packed:
            return states
        offsets: dict[int, int] = {}
        rows, columns = [], []
        for (row, _), count in zip(self.places, counts):
            first = offsets.get(row, 0)
            offsets[row] = first + count
            taken = torch.arange(first, first + max(counts)).clamp(max=first + count - 1)
            rows.append(torch.full_like(taken, row))
            columns.append(taken)
        index = torch.stack(rows).to(states.device), torch.stack(columns).to(states.device)
        return states[:, index[0], :, index[1]].permute(2, 0, 3, 1, 4)  # [sequences, most, ...] -> layers first

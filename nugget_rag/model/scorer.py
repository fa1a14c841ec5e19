"""The Scorer (paper Eq. 15) and the top-k nugget selection (Eq. 14)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import nugget_count


class Scorer(nn.Module):
    """A 2-layer feed-forward network mapping a token's hidden state to one selection score."""

    def __init__(self, hidden_size: int, inner_size: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden_size, inner_size), nn.GELU(), nn.Linear(inner_size, 1))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[batch, n, hidden] -> scores [batch, n]."""
        return self.net(hidden_states).squeeze(-1)


def rank_nuggets(scores: torch.Tensor, lengths: list[int], ratio: float) -> list[torch.Tensor]:
    """For each row the k = ceil(n / r) positions to keep, in resolution order: the last token first, then the rest
    by descending score (ties in position order). Any prefix of k' = ceil(n / r') entries is exactly the selection
    at the coarser ratio r' >= r, so one ranked state serves every coarser ratio (NuggetState.at_ratio)."""
    ranked = []
    for row, n in zip(scores.detach(), lengths):
        k = nugget_count(n, ratio)
        order = row[: n - 1].float().sort(descending=True, stable=True).indices[: k - 1]
        ranked.append(torch.cat([torch.tensor([n - 1], device=row.device), order]))
    return ranked


def select_nuggets(scores: torch.Tensor, lengths: list[int], ratio: float) -> list[torch.Tensor]:
    """For each row keep k = ceil(n / r) positions: the last token always, the rest by top score.

    Returns one ascending LongTensor of positions per row (the original order is kept).
    """
    return [ranked.sort().values for ranked in rank_nuggets(scores, lengths, ratio)]


def select_fixed(scores: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor,
                 budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_nuggets` in fixed shapes, without leaving the device (the compiled training step).

    scores: [rows, width]; lengths: [rows] tokens of each row (0: an absent document); counts: [rows] its k (at most
    `budget`). Returns positions [rows, budget], each row's k chosen ones ascending in its first k slots and the
    row's last token in the rest, and which slots are chosen (True) or padding.
    """
    columns = torch.arange(scores.shape[1], device=scores.device)
    last = (lengths - 1).clamp(min=0)[:, None]
    ranked = scores.detach().float().masked_fill(columns >= last, float("-inf")).masked_fill(columns == last, float("inf"))
    order = ranked.sort(dim=1, descending=True, stable=True).indices[:, :budget]  # the last token, then by score
    slots = torch.arange(budget, device=scores.device)
    chosen = slots < counts[:, None]
    in_order = torch.where(chosen, order, scores.shape[1] + slots).sort(dim=1).values  # chosen ones first, ascending
    return torch.where(chosen, in_order, last), chosen

"""The position scheme, in one place: where documents, nuggets and prompts sit in the encoder's and the decoder's
sequences. The encoder, the decoder, generation, training data, the eval systems and inspection all call these.

- A document is encoded alone, after the document opening (`document_opening`: with the default
  `placement="in_user_turn"`, the chat template up to the user's text, where Full's prompt has the documents;
  nothing with `before_prompt`), and its keys are stored at positions 0..n-1 (`to_document_positions`). A
  document longer than the positions is cut into segments (`segment_length`, `split_segments`), each compressed
  alone and joined at their document-wide positions (`join_segments`).
- When documents are read, the decoder first runs the prompt's prefix (by default that opening; h tokens) at
  0..h-1; the nuggets follow, renumbered in the order given, h..h+K-1 over all documents (each key's rotary phase
  is shifted to its new position, an exact rotation: `compose`), then the rest of the prompt at h+K, h+K+1, ...
  (`decoder_positions`). With `nugget_positions="original"` each nugget keeps its place in its document instead,
  the documents laid end to end (document i's tokens at h + n_1 + ... + n_(i-1) + 0..n_i-1), and the prompt
  continues after the last document's last token. So documents compose in any number and order, and the position budget
  (`check_positions`) is spent on nuggets, not on the original tokens. With r = 1, one document and adapters off
  this is exactly the base model reading Full's prompt (opening, document, rest of the prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerBase

from ..prompts import chat_text, chat_token_ids
from ..state.nugget_state import NuggetState
from .attention import BiasChannelNuggets, ReadNuggets, rotate_keys
from .prefix_rows import PrefixRows, ReadWithPrefixRows

# Stands for the documents while a chat is rendered; a private-use character no real text carries.
DOCUMENTS_MARK = "\ue000documents\ue000"


def check_fixed_rotary(config, name: str) -> None:
    """Refuse a model whose rotary frequencies depend on the sequence length: its keys cannot be moved exactly."""
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"{name} uses rope_type={rope_type!r}, whose frequencies depend on the sequence length, so "
                         "nuggets encoded alone cannot be moved exactly to their place in a prompt; use a checkpoint "
                         "with fixed rotary frequencies (default, linear, llama3, yarn)")


# ---------------------------------------------------------------------------------------------- prompts
def prompt_around_documents(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], in_user_turn: bool
) -> tuple[list[int], list[int]]:
    """The chat's token ids before and after the place where the decoder reads the documents' nuggets.

    in_user_turn: the place the documents' text has in Full's prompt, the start of the last user turn, followed by
    a blank line; otherwise ahead of the whole prompt (nothing before).
    """
    if not in_user_turn:
        return [], chat_token_ids(tokenizer, messages)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError("the documents are read inside a user turn: the messages need one (the question)")
    chat = [dict(m) for m in messages]
    chat[users[-1]]["content"] = f"{DOCUMENTS_MARK}\n\n{chat[users[-1]]['content']}"
    pieces = chat_text(tokenizer, chat).split(DOCUMENTS_MARK)
    if len(pieces) != 2:
        raise ValueError(f"the chat template of {tokenizer.name_or_path!r} does not keep the user's text as it is, so "
                         "the documents' place in it is unknown; use NuggetConfig(placement='before_prompt')")
    before, after = (tokenizer(p, add_special_tokens=False)["input_ids"] for p in pieces)
    return before, after


def document_opening(tokenizer: PreTrainedTokenizerBase, in_user_turn: bool) -> list[int]:
    """The chat's token ids before a user turn's text: what documents are encoded and read after (in_user_turn)."""
    return prompt_around_documents(tokenizer, [{"role": "user", "content": ""}], in_user_turn)[0]


# ---------------------------------------------------------------------------------------------- encoder side
def pad(sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device | str,
        left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ids [batch, width] and their mask (True on real tokens), padded on the right or the left."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, s in enumerate(sequences):
        span = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, span] = torch.tensor(list(s), dtype=torch.long)
        mask[i, span] = True
    return ids.to(device), mask.to(device)


def segment_length(max_positions: int, opening: int, segment_tokens: int | None = None) -> int:
    """Tokens per independently compressed segment: `segment_tokens`, at most (and by default) the model's
    positions less the document opening."""
    if segment_tokens is not None and segment_tokens < 1:
        raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
    room = max_positions - opening
    return min(segment_tokens or room, room)


def split_segments(token_ids: Sequence[Sequence[int]], length: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Every document cut into segments of at most `length` tokens, and each segment's (document, start)."""
    pieces, owners = [], []
    for doc, ids in enumerate(token_ids):
        for start in range(0, len(ids), length):
            pieces.append(list(ids[start : start + length]))
            owners.append((doc, start))
    return pieces, owners


def to_document_positions(keys: torch.Tensor, opening: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys ([..., k, head_dim]) encoded after an opening of that many tokens, moved to positions from 0."""
    if not opening:
        return keys
    return rotate_keys(keys, torch.full((keys.shape[-2],), -opening, device=keys.device), inv_freq)


def join_segments(parts: Sequence[tuple[int, NuggetState]], inv_freq: torch.Tensor) -> NuggetState:
    """One state for a segmented document, from its (start, state) segments: keys move to document-wide positions."""
    keys = [rotate_keys(s.keys, torch.full_like(s.positions, start), inv_freq) for start, s in parts]
    return NuggetState(
        keys=torch.cat(keys, dim=2),
        values=torch.cat([s.values for _, s in parts], dim=2),
        positions=torch.cat([s.positions + start for start, s in parts]),
        scores=torch.cat([s.scores for _, s in parts]),
        tokens=[t for _, s in parts for t in s.tokens],
        n=sum(s.n for _, s in parts),
        fingerprint=parts[0][1].fingerprint,
        floor=parts[0][1].floor,
        segments=tuple(n for _, s in parts for n in s.segments) if parts[0][1].ranked else None,
    )


# ---------------------------------------------------------------------------------------------- decoder side
@dataclass
class NuggetLayout:
    """Nuggets of a batch of samples laid out for the decoder."""

    keys: torch.Tensor  # [layers, batch, kv_heads, K, head_dim]
    values: torch.Tensor
    bias: torch.Tensor  # [batch, K]: straight-through term (paper Eq. 18), -inf on padding
    counts: torch.Tensor  # [batch]: real nuggets per sample
    next_positions: torch.Tensor  # [batch]: the position of each sample's first token after its states
    rows: PrefixRows | None = None  # prompt prefixes that run as rows of the reading pass (their heads: placeholders)

    def reader(self, token_mask: torch.Tensor, query_len: int, fused: bool = False,
               right_padded: bool | None = None) -> ReadNuggets | ReadWithPrefixRows:
        """What the decoder's `query_len` last tokens of `token_mask` attend to the nuggets through: without a float
        mask when `fused` and the tokens allow it (`BiasChannelNuggets.fits`), else under one; with `rows`, inside
        a reader that runs them (`inputs` puts them in the pass). `right_padded=True`: the caller's tokens are
        right-padded and all run now by construction, inside a torch.compile graph (the compiled step), so nothing
        is read back from the device (BiasChannelNuggets' `traced`)."""
        if fused and (BiasChannelNuggets.fits(token_mask, query_len) if right_padded is None else right_padded):
            inner = BiasChannelNuggets(self.keys, self.values, self.bias, token_mask, query_len,
                                       traced=right_padded is not None)
        else:
            inner = ReadNuggets(self.keys, self.values, self.bias, token_mask, query_len)
        return inner if self.rows is None else ReadWithPrefixRows(inner, self.rows)

    def inputs(self, embeds: torch.Tensor, token_mask: torch.Tensor,
               embedding: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decoder pass over right-padded `embeds` (with their `token_mask`) read after these states: its input
        embeddings, the token mask to build `reader` with, and the position ids; with `rows`, the prompt prefixes'
        rows follow the samples' (PrefixRows.inputs), and the pass's first `len(embeds)` rows are the samples'."""
        steps = decoder_positions(self.next_positions, token_mask)
        return (embeds, token_mask, steps) if self.rows is None else self.rows.inputs(embeds, token_mask, steps, embedding)


def no_states(config, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty [layers, kv_heads, 0, head_dim] tensor of a model's key/value states (what `compose` starts from)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return torch.zeros(config.num_hidden_layers, config.num_key_value_heads, 0, head_dim, dtype=dtype, device=device)


def compose(samples: Sequence[Sequence[NuggetState]], empty: torch.Tensor, inv_freq: torch.Tensor,
            nugget_positions: str = "renumbered", rows: PrefixRows | None = None) -> NuggetLayout:
    """Each sample's states (prompt prefix first, then documents) concatenated in order, at positions 0, 1, ...
    (renumbered) or each at its place in its document, the documents end to end (original).

    `empty`: `no_states` of the decoder's dtype and device, which every state is cast to. `rows`: the prompt
    prefixes whose heads are placeholders, to run in the reading pass (NuggetLayout.rows).
    On every nugget the attention bias is `s - s.detach()` of its Scorer score: zero forward, and the gradient of
    each attention logit on it, in every layer and head, reaches the Scorer.
    """
    if nugget_positions not in ("renumbered", "original"):
        raise ValueError(f"nugget_positions must be 'renumbered' or 'original', got {nugget_positions!r}")
    keys, values, biases, shifts, nexts = [], [], [], [], []
    for states in samples:
        states = [state.to(empty.device, empty.dtype) for state in states]
        keys.append(torch.cat([empty, *(s.keys for s in states)], dim=2))
        values.append(torch.cat([empty, *(s.values for s in states)], dim=2))
        scores = torch.cat([torch.zeros(0, device=empty.device), *(s.scores.float() for s in states)])
        biases.append(scores - scores.detach())
        stored = torch.cat([torch.zeros(0, dtype=torch.long, device=empty.device), *(s.positions for s in states)])
        if nugget_positions == "renumbered":
            shifts.append(torch.arange(len(stored), device=empty.device) - stored)
            nexts.append(len(stored))
        else:  # every state moves by the length of the documents before it
            starts = [sum(s.n for s in states[:i]) for i in range(len(states))]
            shifts.append(torch.cat([torch.zeros(0, dtype=torch.long, device=empty.device),
                                     *(torch.full_like(s.positions, start) for s, start in zip(states, starts))]))
            nexts.append(sum(s.n for s in states))
    width = max(1, max(len(d) for d in shifts))
    stacked = torch.stack([F.pad(k, (0, 0, 0, width - k.shape[2])) for k in keys], dim=1)
    shift = torch.stack([F.pad(d, (0, width - len(d))) for d in shifts])  # padding: not moved
    return NuggetLayout(
        keys=rotate_keys(stacked, shift[None, :, None, :], inv_freq),  # every key moved in one rotation
        values=torch.stack([F.pad(v, (0, 0, 0, width - v.shape[2])) for v in values], dim=1),
        bias=torch.stack([F.pad(b, (0, width - len(b)), value=float("-inf")) for b in biases]),
        counts=torch.tensor([len(d) for d in shifts], device=empty.device),
        next_positions=torch.tensor(nexts, device=empty.device),
        rows=rows,
    )


def compose_fixed(keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor,
                  positions: torch.Tensor, lengths: torch.Tensor, examples: int, opening: int, head: int,
                  inv_freq: torch.Tensor,
                  nugget_positions: str = "renumbered", rows: PrefixRows | None = None) -> NuggetLayout:
    """`compose` in fixed shapes, for a batch whose states were never NuggetStates (the compiled training step).

    keys, values: [layers, `examples` * documents, kv_heads, budget, head_dim], captured in the encoder's pass at
    positions `opening` + `positions` ([examples * documents, budget]); `chosen` marks the real slots (the rest are
    padding), `scores` their Scorer scores, `lengths` each document's tokens (0: absent). Each example reads a head of
    `head` placeholder slots (its prompt prefix, filled by `rows` in the pass), then its documents' slots in order:
    every chosen nugget at the position `compose` gives it, so the decoder reads exactly what it would read there.
    """
    documents = scores.shape[0] // examples
    budget = scores.shape[1]
    slots = torch.arange(budget, device=scores.device)
    if nugget_positions == "renumbered":
        counts = chosen.sum(1).view(examples, documents)
        before = (counts.cumsum(1) - counts).reshape(-1, 1)  # nuggets of the example's earlier documents
        target, taken = head + before + slots, counts.sum(1)
    elif nugget_positions == "original":
        spans = lengths.view(examples, documents)
        before = (spans.cumsum(1) - spans).reshape(-1, 1)  # tokens of the example's earlier documents
        target, taken = head + before + positions, spans.sum(1)
    else:
        raise ValueError(f"nugget_positions must be 'renumbered' or 'original', got {nugget_positions!r}")
    shift = torch.where(chosen, target - opening - positions, 0)
    keys = torch.where(chosen[None, :, None, :, None], rotate_keys(keys, shift[:, None, :], inv_freq), 0)
    values = torch.where(chosen[None, :, None, :, None], values, 0)

    def per_example(states: torch.Tensor) -> torch.Tensor:  # head placeholders, then the documents' slots in order
        layers, _, kv_heads, _, head_dim = states.shape
        states = states.view(layers, examples, documents, kv_heads, budget, head_dim).transpose(2, 3)
        states = states.reshape(layers, examples, kv_heads, documents * budget, head_dim)
        return F.pad(states, (0, 0, head, 0))

    scores = scores.float()
    bias = torch.where(chosen, scores - scores.detach(), float("-inf")).view(examples, documents * budget)
    return NuggetLayout(
        keys=per_example(keys), values=per_example(values), bias=F.pad(bias, (head, 0)),
        counts=head + chosen.view(examples, -1).sum(1), next_positions=head + taken, rows=rows,
    )


def decoder_positions(next_positions: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Positions of the decoder's tokens (left or right padded): from each sample's `NuggetLayout.next_positions`."""
    return (next_positions[:, None] + token_mask.long().cumsum(1) - 1).clamp(min=0)


def check_positions(max_positions: int, states: int, tokens: int) -> None:
    """Refuse a decoder input whose prompt opening and nuggets take `states` positions (their count, or with
    original positions the documents' length) and whose `tokens` tokens follow, when it cannot fit."""
    if states + tokens > max_positions:
        raise ValueError(
            f"the prompt opening and nuggets take {states} positions, plus {tokens} prompt tokens: more than the "
            f"model's {max_positions} positions; pass fewer documents, a shorter prompt, or compress at a larger r"
        )

"""Autoregressive mode (paper Sec. 2.2): one model reads a text of any length from left to right, and the past
survives as nuggets.

The text is read in segments of `segment` tokens that share one split point (the paper's efficiency measure). A
token of the segment starting at text position a attends to
- the nuggets of every token before a - window: the encoder's key/values there, one after another at positions
  0..K-1, each with the straight-through bias `s - s.detach()` of its Scorer score (Eq. 18),
- the `window` tokens before a, whole, at K..K+window-1 (Eq. 9: the decoder's own key/values),
- the tokens of its own segment up to itself.
When a segment is complete the encoder reads it the same way (nuggets, then its own whole window), and the Scorer
(over the frozen model's early layers, reading the window and the segment) keeps the segment's top ceil(segment/r)
tokens, its last token always, or every token scoring above a threshold Λ (Eq. 8) and the last.

Attention over the past therefore costs at most K + window + segment keys, and positions stay below that; the nuggets
read are capped (`max_nuggets`, by default what the model's positions leave; the oldest are dropped first), so memory
is bounded for any length. With r = 1 and adapters off every token is kept at its own position: the base model.
"""

from __future__ import annotations

import codecs
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..config import NuggetConfig, StreamSettings
from ..model.attention import ReadAndRecord, rotate_keys
from ..model.layout import no_states
from ..model.nugget_model import NuggetModel
from ..model.scorer import select_nuggets
from ..state.nugget_state import NuggetState
from .decoding import GenerationSettings, TextTracker, eos_ids, next_token

log = logging.getLogger(__name__)


@dataclass
class _KV:
    """Every layer's keys and values of some tokens, [layers, kv_heads, n, head_dim], keys at rotary phase 0."""

    keys: torch.Tensor
    values: torch.Tensor

    def __len__(self) -> int:
        return self.keys.shape[2]

    def __add__(self, other: _KV) -> _KV:
        return _KV(torch.cat([self.keys, other.keys], 2), torch.cat([self.values, other.values], 2))

    def take(self, index: torch.Tensor | slice) -> _KV:
        return _KV(self.keys[:, :, index], self.values[:, :, index])

    def last(self, n: int) -> _KV:
        return self.take(slice(max(0, len(self) - n), None))


class NuggetStream:
    """Reads one text in autoregressive mode: `feed` tokens (or `read` text chunks), `generate` its continuation.

    Holds only the nuggets read (capped), the whole window, and the segment being read; see the module docstring.
    Gradients flow through everything read (the LM objective trains through it).
    """

    def __init__(self, model: NuggetModel, settings: StreamSettings | None = None, **fields):
        if settings is not None and fields:
            raise ValueError("pass StreamSettings or its fields, not both")
        self.model = model
        self.settings = settings = settings or StreamSettings(**fields)
        self.window = settings.window
        self.segment = settings.segment or max(settings.window, 16)
        self.ratio = model.config.ratio if settings.ratio is None else settings.ratio
        room = model.max_positions - self.window - self.segment
        if room < 0:
            raise ValueError(f"window={self.window} and segment={self.segment} tokens take more than the model's "
                             f"{model.max_positions} positions; use a smaller window or segment")
        if settings.max_nuggets is not None and settings.max_nuggets > room:
            raise ValueError(f"max_nuggets={settings.max_nuggets} nuggets, window={self.window} and segment="
                             f"{self.segment} take more than the model's {model.max_positions} positions; use "
                             f"max_nuggets <= {room}")
        self.max_nuggets = settings.max_nuggets or room
        self.reset()

    def reset(self) -> None:
        """Forget everything read."""
        empty = no_states(self.model.llama.config, self.model.dtype, self.model.device)
        self.nuggets = _KV(empty, empty)
        self.nugget_positions = torch.zeros(0, dtype=torch.long, device=self.model.device)  # in the text
        self.nugget_scores = torch.zeros(0, device=self.model.device)
        self.nugget_ids: list[int] = []
        self.encoder_window, self.decoder_window, self.window_ids = _KV(empty, empty), _KV(empty, empty), []
        self.open_ids: list[int] = []  # the segment being read
        self.n = 0  # tokens read
        self.dropped = 0  # nuggets dropped by the cap
        self.last_logits: torch.Tensor | None = None  # what the last token read predicts
        self.generated: list[int] = []  # the ids the last `generate` produced (and read)
        self._prefix: tuple | None = None  # the decoder's past (`_compose`) for the open segment, its tokens included

    # ------------------------------------------------------------------ reading
    @property
    def visible(self) -> torch.Tensor:
        """Mask of the nuggets the open segment reads: those older than its window."""
        start = self.n - len(self.open_ids)
        return self.nugget_positions < start - len(self.window_ids)

    @property
    def reads_nuggets_from(self) -> int:
        """The first text position whose token reads nuggets: the start of the first segment past the window."""
        return (self.window // self.segment + 1) * self.segment

    @property
    def kv_size(self) -> int:
        """Key/value states the next token attends to (nuggets, window, open segment)."""
        return int(self.visible.sum()) + len(self.window_ids) + len(self.open_ids)

    def feed(self, token_ids: Sequence[int], return_logits: bool = False) -> torch.Tensor | None:
        """Read tokens; with return_logits, what each predicts ([len, vocab]), else None (`last_logits` is kept)."""
        ids = [int(t) for t in token_ids]
        if any(t < 0 or t >= self.model.llama.config.vocab_size for t in ids):
            raise ValueError(f"token ids must be in 0..{self.model.llama.config.vocab_size - 1}")
        outputs, start = [], 0
        while start < len(ids):
            piece = ids[start : start + self.segment - len(self.open_ids)]
            hidden = self._decode(piece)
            if return_logits:
                outputs.append(self.model.logits(hidden))
            self.last_logits = outputs[-1][-1] if return_logits else self.model.logits(hidden[-1:])[0]
            self.open_ids += piece
            self.n += len(piece)
            start += len(piece)
            if len(self.open_ids) == self.segment:
                self._close()
        if not return_logits:
            return None
        return torch.cat(outputs) if outputs else torch.zeros(0, self.model.llama.config.vocab_size)

    def read(self, chunks: Iterable[str | bytes]) -> int:
        """Read text arriving in chunks (str, or UTF-8 bytes split anywhere); returns the tokens read."""
        before, reader = self.n, TextChunks(self.model.tokenizer)
        for chunk in chunks:
            self.feed(reader.add(chunk))
        self.feed(reader.finish())
        if self.n == before:
            raise ValueError("the text is empty: nothing to read")
        return self.n - before

    def flush(self) -> None:
        """Compress the segment being read now, however short, so that every token read is in the nuggets."""
        if self.open_ids:
            self._close()

    def to_state(self) -> NuggetState:
        """Every nugget kept so far as one NuggetState (keys at their text positions), as compressor mode makes;
        `flush` first to include the segment being read."""
        if not self.nugget_ids:
            raise ValueError("nothing is compressed yet: feed a whole segment, or flush")
        keys = rotate_keys(self.nuggets.keys, self.nugget_positions, self.model.inv_freq)
        tokens = self.model.tokenizer.convert_ids_to_tokens(self.nugget_ids)
        fingerprint = self.model.state_tag(f"autoregressive:{self.settings.model_dump_json()}:"
                                           f"{self.model.fingerprint(self.ratio, self.settings.encoder)}")
        return NuggetState(keys, self.nuggets.values, self.nugget_positions,
                           self.nugget_scores, tokens, self.n, fingerprint)

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, settings: GenerationSettings | None = None) -> Iterator[str]:
        """Continue the text read, yielding new text; what is generated is read too (the stream goes on), and its ids
        are in `generated`."""
        settings = settings or GenerationSettings()
        if self.last_logits is None:
            raise ValueError("nothing read yet: feed a prompt before generating")
        generator = (torch.Generator(self.model.device).manual_seed(settings.seed)
                     if settings.seed is not None else None)
        tokenizer = self.model.tokenizer
        tracker, processors, eos = TextTracker(tokenizer, settings.stop), settings.logits_processors(tokenizer), \
            eos_ids(self.model)
        self.generated = []
        for step in range(settings.max_new_tokens + settings.finish_sentence):
            logits = self.last_logits[None]
            if processors and self.generated:
                logits = processors(torch.tensor([self.generated], device=logits.device), logits)
            token = int(next_token(logits, settings, generator)[0])
            if token in eos or (step >= settings.max_new_tokens and tracker.ends_sentence_before(token)):
                break
            self.feed([token])
            self.generated.append(token)
            piece = tracker.add(token)
            if piece:
                yield piece
            if tracker.done:
                return
        rest = tracker.finish()
        if rest:
            yield rest

    # ------------------------------------------------------------------ internals
    def _compose(self, window: _KV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Keys, values and attention bias of the visible nuggets at 0..K-1 and the window after them, and the
        position of the open segment's first token."""
        visible = self.visible
        nuggets = self.nuggets.take(visible)
        count = len(nuggets)
        steps = torch.arange(count + len(window), device=self.model.device)
        past = nuggets + window
        scores = self.nugget_scores[visible]
        bias = torch.cat([scores - scores.detach(), scores.new_zeros(len(window))])
        return rotate_keys(past.keys, steps, self.model.inv_freq), past.values, bias, count + len(window)

    def _run(self, adapter: str | None, ids: list[int], past: tuple) -> tuple[torch.Tensor, _KV, torch.Tensor]:
        """One pass over `ids` reading `past` (`_compose`'s); the hidden states, the tokens' key/values at their
        positions in this layout, and those positions."""
        keys, values, bias, start = past
        steps = torch.arange(start, start + len(ids), device=keys.device)
        reader = ReadAndRecord(keys[:, None], values[:, None], bias[None],
                               torch.ones(1, len(ids), dtype=torch.bool, device=keys.device), len(ids))
        hidden = self.model.run(adapter, reader, input_ids=torch.tensor([ids], device=keys.device),
                                position_ids=steps[None])
        new_keys, new_values = reader.recorded.stacked()
        return hidden[0], _KV(new_keys[:, 0], new_values[:, 0]), steps

    def _at_phase_zero(self, kv: _KV, steps: torch.Tensor) -> _KV:
        return _KV(rotate_keys(kv.keys, -steps, self.model.inv_freq), kv.values)

    def _decode(self, ids: list[int]) -> torch.Tensor:
        """The decoder's pass over tokens of the open segment; they join its view of the past for the next ones."""
        if self._prefix is None:
            self._prefix = self._compose(self.decoder_window)
        hidden, recorded, steps = self._run(self.settings.decoder, ids, self._prefix)
        keys, values, bias, start = self._prefix
        self._prefix = (torch.cat([keys, recorded.keys], 2), torch.cat([values, recorded.values], 2),
                        torch.cat([bias, bias.new_zeros(len(ids))]), start + len(ids))
        return hidden

    def _close(self) -> None:
        """The open segment is complete: encode it, keep its nuggets, move the window on, apply the cap."""
        ids, start = self.open_ids, self.n - len(self.open_ids)
        keys, values, _, end = self._prefix  # the decoder's past ends with the open segment's tokens
        steps = torch.arange(end - len(ids), end, device=keys.device)
        decoded = self._at_phase_zero(_KV(keys, values).last(len(ids)), steps)
        _, encoded, steps = self._run(self.settings.encoder, ids, self._compose(self.encoder_window))
        encoded = self._at_phase_zero(encoded, steps)
        scores = self.model.score(torch.tensor([self.window_ids + ids], device=self.model.device))[0]
        scores = scores[len(self.window_ids):]
        chosen = self._select(scores)
        self.nuggets = self.nuggets + encoded.take(chosen)
        self.nugget_positions = torch.cat([self.nugget_positions, chosen + start])
        self.nugget_scores = torch.cat([self.nugget_scores, scores[chosen].to(self.nugget_scores.dtype)])
        self.nugget_ids += [ids[i] for i in chosen.tolist()]
        self.encoder_window = (self.encoder_window + encoded).last(self.window)
        self.decoder_window = (self.decoder_window + decoded).last(self.window)
        self.window_ids = (self.window_ids + ids)[max(0, len(self.window_ids) + len(ids) - self.window):]
        self.open_ids, self._prefix = [], None
        excess = int(self.visible.sum()) - self.max_nuggets
        if excess > 0:  # the oldest go first
            self.nuggets = self.nuggets.take(slice(excess, None))
            self.nugget_positions, self.nugget_scores = self.nugget_positions[excess:], self.nugget_scores[excess:]
            self.nugget_ids = self.nugget_ids[excess:]
            self.dropped += excess

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        if self.settings.threshold is None:
            return select_nuggets(scores[None], [len(scores)], self.ratio)[0]
        above = (scores.detach()[:-1] > self.settings.threshold).nonzero().flatten()
        return torch.cat([above, above.new_tensor([len(scores) - 1])])


@torch.no_grad()
def calibrate_threshold(model: NuggetModel, token_ids: Sequence[Sequence[int]], ratio: float) -> float:
    """The threshold Lambda above which about 1/r of the tokens of these sample texts score (paper Sec. 2.2)."""
    ratio = NuggetConfig(ratio=ratio).ratio
    scores = [model.score(torch.tensor([list(ids[: model.max_positions])], device=model.device))[0]
              for ids in token_ids if len(ids)]
    if not scores:
        raise ValueError("calibrate_threshold needs at least one non-empty sample text")
    return float(torch.cat(scores).float().quantile(1 - 1 / ratio))


class TextChunks:
    """Incremental tokenisation of text that arrives in pieces: a piece may end inside a word, a token or (as bytes)
    a UTF-8 character. Text is released up to its last whitespace, where byte-level BPE pre-tokenisers split, so the
    ids released add up to the ids of the whole text."""

    _TAIL = re.compile(r"\s+\S*\Z")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.pending = ""

    def add(self, chunk: str | bytes) -> list[int]:
        if isinstance(chunk, (bytes, bytearray)):
            chunk = self.utf8.decode(bytes(chunk))
        elif not isinstance(chunk, str):
            raise TypeError(f"text chunks must be str or bytes, got {type(chunk).__name__}")
        self.pending += chunk
        tail = self._TAIL.search(self.pending)
        cut = tail.start() if tail else 0
        ready, self.pending = self.pending[:cut], self.pending[cut:]
        return self._ids(ready)

    def finish(self) -> list[int]:
        try:
            self.pending += self.utf8.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError("the byte stream ended inside a UTF-8 character: its last bytes are missing") from None
        ready, self.pending = self.pending, ""
        return self._ids(ready)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

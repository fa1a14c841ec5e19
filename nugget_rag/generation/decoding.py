"""Generation from nuggets: incremental decoding with a KV cache, greedy or sampled, batched, streamed as text."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterator, Sequence
from typing import Literal, TypedDict, Unpack, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
)

from ..cancellation import check
from ..config import DECODER, Decoding
from ..model.layout import NuggetLayout, decoder_positions
from ..model.nugget_model import NuggetModel
from ..state.nugget_state import NuggetState
from .repeats import NoRepeatPrintedNGram
from .static_decoding import StaticDecoding
from .text import ends_sentence

log = logging.getLogger(__name__)


class GenerationSettings(BaseModel):
    """How text is generated (greedy when temperature is 0, as in the paper)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="0 = greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list, description="Generation ends before the first of these strings.")
    finish_sentence: int = Field(
        0, ge=0, description="Past max_new_tokens, up to this many more tokens to end the sentence the limit cut (at a "
        "'.', '!' or '?' followed by whitespace, or a blank line); 0: the limit is hard."
    )
    seed: int | None = Field(None, description="Seed for sampling.")
    repetition_penalty: float = Field(
        1.0, ge=1.0, allow_inf_nan=False, description="Above 1, makes tokens already generated less likely (CTRL's penalty: their positive "
        "logits divided by it, negative ones multiplied); 1 = off."
    )
    no_repeat_ngram_size: int = Field(
        0, ge=0, description="Never print an n-gram of this many tokens twice in one answer, tokens compared by the "
        "text they print (' a' and 'a' alike; whitespace-only tokens skipped: repeats.py); 0 = off."
    )

    def logits_processors(self, tokenizer) -> LogitsProcessorList:
        """The processors of the repetition settings; they see the generated tokens, not the prompt."""
        processors = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.no_repeat_ngram_size:
            processors.append(NoRepeatPrintedNGram(self.no_repeat_ngram_size, tokenizer))
        return processors


FinishReason = Literal["stop", "length"]


class RowSteps(Iterator[str]):
    """One row's new text per step, from its (text, finish reason or None) steps; `finish_reason` once it ends."""

    def __init__(self, steps: Iterator[tuple[str, FinishReason | None]]):
        self._steps = steps
        self.finish_reason: FinishReason | None = None

    def __next__(self) -> str:
        piece, self.finish_reason = next(self._steps)
        return piece

    def close(self) -> None:
        """Stop reading (a consumer that leaves): closes the steps."""
        self._steps.close()


class TextTracker:
    """Incremental detokenisation of one row: releases only text that no stop string can still claim."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # the ids decoded
        self.sent = 0
        self.done = False

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.done = True
            return self._release(text[: min(hits)])
        if text.endswith("\ufffd"):  # an incomplete multi-byte character
            return ""
        held = max((len(s) - 1 for s in self.stop), default=0)
        for size in range(min(held, len(text)), 0, -1):
            if any(s.startswith(text[-size:]) for s in self.stop):
                return self._release(text[:-size])
        return self._release(text)

    def ends_sentence_before(self, token: int) -> bool:
        """Whether the text so far ends a sentence (`text.ends_sentence`) that `token` would not continue: whitespace
        after it already, or `token` starting with some."""
        text = self.text
        if not ends_sentence(text):
            return False
        if text != text.rstrip():
            return True
        return self.tokenizer.decode([*self.ids, token], skip_special_tokens=True)[len(text) : len(text) + 1].isspace()

    def finish(self) -> str:
        return "" if self.done else self._release(self.text)

    def _release(self, text: str) -> str:
        piece = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return piece


def next_token(logits: torch.Tensor, settings: GenerationSettings, generator: torch.Generator | None) -> torch.Tensor:
    if settings.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / settings.temperature, dim=-1)
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > settings.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class DecoderOptions(TypedDict, total=False):
    """How the decoder reads each row besides its documents' states and prompt: the keyword arguments that
    `generate`, `stream_generate` and `generation_steps` share."""

    soft_prompt: bool  # the soft prompt before the prompt (default False)
    adapter: str | None  # the adapter that decodes (default DECODER; None: the base model)
    prefixes: Sequence[Sequence[int] | None] | None  # each row's prompt prefix (default None: the document opening)


def stream_generate(model: NuggetModel, samples: Sequence[Sequence[NuggetState]], prompts: Sequence[Sequence[int]],
                    settings: GenerationSettings | None = None,
                    **options: Unpack[DecoderOptions]) -> Iterator[list[str]]:
    """Yield, step by step, the new text of each row ('' when a row has nothing new or is finished).

    Each row reads its prompt prefix (`NuggetModel.chat_prompt`; None: the document opening), the nuggets of its
    documents, then its prompt tokens (left-padded in the batch). The prompt is run once; every later step feeds
    one token per row against the cached keys/values.
    """
    for pieces, _ in generation_steps(model, samples, prompts, settings, **options):
        yield pieces


@torch.inference_mode()
def generation_steps(model: NuggetModel, samples: Sequence[Sequence[NuggetState]], prompts: Sequence[Sequence[int]],
                     settings: GenerationSettings | None = None, *, leave: Collection[int] = (),
                     **options: Unpack[DecoderOptions]) -> Iterator[tuple[list[str], list[FinishReason | None]]]:
    """`stream_generate`'s steps, each with every row's finish reason once that step's text is its last (None
    before): "stop" where an end-of-sequence token or a stop string ended it, "length" where the token budget
    (max_new_tokens, or the model's positions) cut it. With `settings.finish_sentence`, a row the budget would cut
    mid-sentence goes on to the sentence's end, for at most that many tokens more ("length" still: it was cut).

    A finished row leaves the batch: later steps decode only the others. So does a row whose index the caller has
    put in `leave` (its request was cancelled) by the time it asks for the next step; its text is '' from then on.
    The steps end once no row is left to decode. Inside a `cancellable` block (cancellation.py), each step first
    checks it: a cancelled request's steps end with RequestCancelled.
    """
    settings = settings or GenerationSettings()
    if unknown := sorted(options.keys() - DecoderOptions.__annotations__.keys()):
        raise TypeError(f"unknown decoder options {unknown}: the decoder takes {sorted(DecoderOptions.__annotations__)}")
    soft_prompt, adapter = options.get("soft_prompt", False), options.get("adapter", DECODER)
    if len(samples) != len(prompts):
        raise ValueError(f"got {len(samples)} document lists for {len(prompts)} prompts")
    if any(len(p) == 0 for p in prompts) and not (soft_prompt and model.soft_prompt.shape[0]):
        raise ValueError("every prompt needs at least one token (an empty one only after the soft prompt)")
    input_ids, token_mask = model.pad(prompts, left=True)
    layout = model.layout(samples, options.get("prefixes"), adapter)
    embeds, token_mask = model.embed(input_ids, token_mask, soft_prompt)
    model.check_positions(int(layout.next_positions.max()), embeds.shape[1] + 1)  # room for one new token at least
    budget = model.max_positions - int(layout.next_positions.max()) - embeds.shape[1]
    steps = min(settings.max_new_tokens + settings.finish_sentence, budget)
    if budget < settings.max_new_tokens:
        log.warning("max_new_tokens=%d cut to %d: the states and prompt take the rest of the model's %d positions",
                    settings.max_new_tokens, steps, model.max_positions)
    eos = eos_ids(model)
    generator = torch.Generator(model.device).manual_seed(settings.seed) if settings.seed is not None else None
    trackers = [TextTracker(model.tokenizer, settings.stop) for _ in prompts]
    reasons: list[FinishReason | None] = [None] * len(prompts)
    processors = settings.logits_processors(model.tokenizer)
    generated = torch.zeros(len(prompts), 0, dtype=torch.long, device=model.device)
    positions = decoder_positions(layout.next_positions, token_mask)
    prefilled = prefill_nuggets(layout, token_mask)
    cache = DynamicCache() if prefilled is None else prefilled[0]
    if model.decoding not in get_args(Decoding):
        raise ValueError(f"model.decoding is {model.decoding!r}; use one of {get_args(Decoding)}")
    static = None  # decoding over a static cache keeps every row in the batch: its step's shapes never change
    if model.decoding != "dynamic" and prefilled is not None:
        static = StaticDecoding(model, layout.keys, layout.values, prefilled[1], embeds.shape[1] + steps,
                                compiled=model.decoding == "compiled")
    active = list(range(len(prompts)))  # the rows in the batch, by their index among the prompts
    for step in range(steps):
        check()
        # The model is shared: `run` holds it for one step, never across a yield, so that other calls (another
        # stream, a compression) interleave with a paused stream instead of waiting for it. The KV cache is ours.
        if static is not None:
            hidden = static.run(model, adapter, embeds, positions, token_mask[:, -embeds.shape[1] :])
        elif prefilled is None:
            hidden = model.run(adapter, layout.reader(token_mask, embeds.shape[1]), inputs_embeds=embeds,
                               position_ids=positions, cache=cache)
        else:  # the nuggets are the cache's first entries: standard attention (no mask at all without padding)
            attention_mask = torch.cat([prefilled[1], token_mask], dim=1)
            hidden = model.run(adapter, inputs_embeds=embeds, position_ids=positions, cache=cache,
                               attention_mask=None if attention_mask.all() else attention_mask.long())
        logits = model.logits(hidden[:, -1])
        if processors and generated.shape[1]:
            logits = processors(generated, logits)
        tokens = next_token(logits, settings, generator)
        if processors:  # only the repetition settings need the history
            generated = torch.cat([generated, tokens[:, None]], dim=1)
        pieces = [""] * len(prompts)
        for i, token in zip(active, tokens.tolist()):
            if reasons[i] is not None or i in leave:  # a row kept in a static batch after it ended
                continue
            tracker = trackers[i]
            if step >= settings.max_new_tokens and tracker.ends_sentence_before(token):  # the overtime's end
                pieces[i] = tracker.finish()
                reasons[i] = "length"
                continue
            if token in eos:
                pieces[i] = tracker.finish()
                tracker.done = True
            else:
                pieces[i] = tracker.add(token)
            if tracker.done:  # an end-of-sequence token, or a stop string
                reasons[i] = "stop"
            elif step == steps - 1:
                pieces[i] += tracker.finish()
                reasons[i] = "length"
        yield pieces, list(reasons)
        keep = [j for j, i in enumerate(active) if reasons[i] is None and i not in leave]
        if not keep:
            return
        if len(keep) < len(active) and static is None:  # rows left: the next steps decode only the others
            active = [active[j] for j in keep]
            rows = torch.tensor(keep, device=model.device)
            tokens, token_mask, positions, generated = tokens[rows], token_mask[rows], positions[rows], generated[rows]
            cache.batch_select_indices(rows)
            if prefilled is None:
                layout = dataclasses.replace(layout, keys=layout.keys[:, rows], values=layout.values[:, rows],
                                             bias=layout.bias[rows], counts=layout.counts[rows],
                                             next_positions=layout.next_positions[rows])
            else:
                prefilled = cache, prefilled[1][rows]
        embeds = model.llama.get_input_embeddings()(tokens[:, None])
        token_mask = torch.cat([token_mask, token_mask.new_ones(len(active), 1)], dim=1)
        positions = positions[:, -1:] + 1


def prefill_nuggets(layout: NuggetLayout, token_mask: torch.Tensor) -> tuple[DynamicCache, torch.Tensor] | None:
    """The nuggets (and prompt-prefix states) of a layout as the first entries of a KV cache, with their attention
    mask ([batch, K], False on padding): generation then runs transformers' own attention. None where a row would
    attend to nothing at all (left padding before a row without states), which the nugget mask handles instead.
    Generation reads without gradients, so the straight-through bias, zero in the forward pass, is left out."""
    present = torch.isfinite(layout.bias)
    if not (present.any(dim=1).all() or token_mask.all()):
        return None
    cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in zip(layout.keys, layout.values)])
    return cache, present


def generate(model: NuggetModel, samples: Sequence[Sequence[NuggetState]], prompts: Sequence[Sequence[int]],
             settings: GenerationSettings | None = None, **options: Unpack[DecoderOptions]) -> list[str]:
    """The generated text of each row."""
    texts = [""] * len(prompts)
    for pieces in stream_generate(model, samples, prompts, settings, **options):
        texts = [t + p for t, p in zip(texts, pieces)]
    return texts


def eos_ids(model: NuggetModel) -> set[int]:
    ids = model.llama.generation_config.eos_token_id if model.llama.generation_config else None
    ids = list(ids) if isinstance(ids, list) else [ids]
    ids.append(model.tokenizer.eos_token_id)
    return {i for i in ids if i is not None}

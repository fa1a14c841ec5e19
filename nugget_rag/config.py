"""Pydantic configuration of the nugget parts (what a checkpoint saves beside its weights), and the constants the
layers share."""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

ENCODER = "encoder"
DECODER = "decoder"
PROBE_RATIO = 4.0  # the ratio the default policy reads every retrieved passage at, so the finest a store keeps
# The default against loops of the package's answers (its chat models, `nugget-rag ask`, the server's /ask and
# OpenAI route): no n-gram of this many tokens twice in an answer. Chosen on squad_rag dev (BENCHMARKS.md,
# "Answers that end, once"); GenerationSettings and the eval harness keep the paper's plain greedy decoding.
ANSWER_NO_REPEAT_NGRAM_SIZE = 8
MergedFormat = Literal["float", "int8"]  # how passes without autograd run merged adapters (adapters.py, int8.py)
# How generation decodes after the prompt (static_decoding.py): "dynamic", a KV cache that grows, eager (the default);
# "static", a preallocated one; "compiled", static, each one-token step through torch.compile (CUDA graphs on CUDA).
Decoding = Literal["dynamic", "static", "compiled"]
# How a long document's summary reads its sections' nuggets (integrations/summary_chain.py); the first is the default,
# chosen by measurement (BENCHMARKS.md, "Long documents").
SummaryReading = Literal["outline", "sections", "nuggets"]
# A Ray cluster's address: HOST:PORT (the head's GCS port) or ray://HOST:PORT (Ray Client); "auto" is also taken.
RAY_ADDRESS = re.compile(r"(ray://)?(?P<host>[^\s:/\[\]]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})")


class LoraSettings(BaseModel):
    """LoRA adapter settings, shared by the encoder (phi) and decoder (theta) adapters."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(32, ge=1, description="LoRA rank (the paper uses 32).")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / rank).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear layers that get adapters.",
    )


LEGACY_PLACEMENT = "before_prompt"  # what a checkpoint without a `placement` key was trained with


class NuggetConfig(BaseModel):
    """How a document is compressed into nuggets and read back (paper Sec. 2.3 and App. B)."""

    model_config = ConfigDict(extra="forbid")

    ratio: float = Field(
        10.0,
        description="Compression ratio r: a document of n tokens keeps k = ceil(n / r) nuggets.",
    )
    scorer_layer: int = Field(
        3, ge=1, description="The Scorer reads the hidden states after this many layers of the frozen base model."
    )
    scorer_hidden: int | None = Field(
        None, ge=1, description="Hidden width of the Scorer's 2-layer FFN (default: the model's hidden size)."
    )
    placement: Literal["in_user_turn", "before_prompt"] = Field(
        "in_user_turn",
        description="Where the decoder reads the nuggets of a chat prompt: in_user_turn, in the place of the "
        "documents' text in Full's prompt (after the chat template's opening, which the decoder runs first); "
        "before_prompt, ahead of the whole prompt (checkpoints written before this field existed).",
    )
    nugget_positions: Literal["renumbered", "original"] = Field(
        "renumbered",
        description="Where the decoder places the nuggets it reads: renumbered, one after another over all documents "
        "(the position budget goes to nuggets: r times more document text fits); original, each at its place in its "
        "document, the documents laid end to end (as key/value eviction methods keep them; documents must fit the "
        "positions as text).",
    )
    soft_prompt_tokens: int = Field(
        1, ge=0, description="Trainable soft tokens put before the decoder's text in autoencoding."
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)
    seed: int = Field(0, description="Seed of the Scorer and soft-prompt initialisation (fixes an untrained model's fingerprint).")

    @field_validator("ratio", mode="before")
    @classmethod
    def _check_ratio(cls, value: object) -> float:
        if isinstance(value, str):  # from a CLI flag or an environment variable
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"ratio must be a number >= 1 (such as 10), got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"ratio must be a number >= 1 (such as 10), got {value!r}")
        if not math.isfinite(value) or value < 1:
            raise ValueError(f"ratio must be a finite number >= 1 (such as 10), got {value!r}")
        return float(value)


class StreamSettings(BaseModel):
    """How autoregressive mode reads: the recent window kept whole, the segment length, and which nuggets stay."""

    model_config = ConfigDict(extra="forbid")

    window: int = Field(128, ge=0, description="tau: the tokens before a segment that its tokens read whole.")
    segment: int | None = Field(
        None, ge=1, description="Tokens read in one pass, sharing one split point (default: the window, at least 16).")
    ratio: float | None = Field(None, description="Keep ceil(segment / r) tokens of each segment (default: the "
                                "model's r).")
    threshold: float | None = Field(
        None, allow_inf_nan=False, description="Lambda (Eq. 8): keep instead every token whose score is above it "
        "(and each segment's last token); `calibrate_threshold` finds the one giving a ratio.")
    max_nuggets: int | None = Field(
        None, ge=1, description="Nuggets read at most; the oldest are dropped beyond it (default and maximum: the "
        "model's positions less the window and a segment).")
    encoder: str | None = Field(ENCODER, description="The adapter that encodes nuggets (None: the frozen model).")
    decoder: str | None = Field(DECODER, description="The adapter that reads them (None: the frozen model).")

    @field_validator("ratio")
    @classmethod
    def _check_ratio(cls, value: float | None) -> float | None:
        return value if value is None else NuggetConfig(ratio=value).ratio


def nugget_count(n_tokens: int, ratio: float) -> int:
    """k = ceil(n / r): the number of nuggets kept of a text of n tokens."""
    return max(1, math.ceil(round(n_tokens / ratio, 9)))  # r = 1.15 is a hair under 1.15: 115 / r is 100

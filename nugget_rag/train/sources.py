"""What a training run reads: its data sources, each feeding one objective, and the token budgets of their examples.

TrainConfig (config.py) checks each source's objective against the registry (objectives.py), which reads these.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..config import NuggetConfig

Format = Literal["auto", "squad", "hotpotqa", "json", "jsonl", "parquet", "text", "hub"]


class MixedReadings(BaseModel):
    """rag_qa examples (RAFT-style): a question's gold passage among the same-article passages that match the question
    best (BM25), each read at its own ratio drawn from small discrete sets (Semi-Dynamic). r = 1 reads a passage as
    its text is read (the frozen model's key/values), as a resolution policy reads the passage it expands."""

    model_config = ConfigDict(extra="forbid")

    passages: int = Field(4, ge=1, description="Passages per example: the gold one and the closest distractors.")
    whole_ratios: list[float] = Field(default_factory=lambda: [1.0, 2.0], min_length=1,
                                      description="Ratios the gold passage is read at (1: as text).")
    skim_ratios: list[float] = Field(default_factory=lambda: [5.0, 10.0, 20.0], min_length=1,
                                     description="Ratios the distractors (and a compressed gold) are read at.")
    gold_compressed: float = Field(0.2, ge=0, le=1, description="Share of examples whose gold is skimmed too.")
    no_gold: float = Field(0.1, ge=0, le=1, description="Share of examples without the gold passage.")
    no_gold_answer: str = Field("The documents do not say.", min_length=1,
                                description="The target when no passage holds the answer (SQuAD has no such "
                                            "questions, so the answer is this wording).")

    @field_validator("whole_ratios", "skim_ratios")
    @classmethod
    def _check_ratios(cls, value: list[float]) -> list[float]:
        return [NuggetConfig(ratio=r).ratio for r in value]

    @model_validator(mode="after")
    def _check(self) -> MixedReadings:
        if self.gold_compressed + self.no_gold > 1:
            raise ValueError(f"gold_compressed {self.gold_compressed} + no_gold {self.no_gold} exceed 1")
        return self


class Source(BaseModel):
    """One data source feeding one objective."""

    model_config = ConfigDict(extra="forbid")

    objective: str = Field(description="A registered objective (train/objectives.py; TrainConfig checks it): "
                                       "autoencoding | continuation | qa | summarization | language_modeling "
                                       "(autoregressive mode).")
    path: str = Field(description="A local file or folder, or a hub data set name (format=hub; needs network).")
    format: Format = Field("auto", description="File format; auto: from the suffix (SQuAD JSON is recognised).")
    split: Literal["train", "dev", "test"] | None = Field(
        "train", description="Part of the file to train on, by the splits.json beside it (None: the whole file)."
    )
    dev_split: Literal["train", "dev", "test"] | None = Field(
        "dev", description="Part used for periodic evaluation (None: no evaluation of this source)."
    )
    dev_path: str | None = Field(None, description="The file evaluation reads `dev_split` of (default: path), e.g. a "
                                                   "corpus whose dev part is a file of its own.")
    weight: float = Field(1.0, gt=0, description="Share of training batches drawn from this source.")
    text_field: str = Field("text", description="Field of the text (autoencoding, continuation).")
    document_field: str = Field("article", description="Field of the document (summarization).")
    context_field: str = Field("context", description="Field of the document (qa, non-SQuAD files).")
    summary_field: str = Field("highlights", description="Field of the reference summary (summarization).")
    question_field: str = Field("question", description="Field of the question (qa, non-SQuAD files).")
    answer_field: str = Field("answers", description="Field of the answer(s) (qa, non-SQuAD files).")
    documents_per_example: int = Field(
        1, ge=1, description="Multi-document examples: qa adds this many - 1 other passages as distractors, in random "
                             "order; summarization makes a digest of this many documents of the batch, in random "
                             "order, the target their summaries in that order; continuation cuts d into this many "
                             "pieces; each piece is compressed on its own.",
    )
    full_context: bool = Field(
        False, description="Reference without compression: the whole document in the prompt, decoder adapter only "
                           "(qa and summarization).",
    )
    streaming: bool = Field(False, description="Stream records (corpora larger than memory; hub or local files).")
    readings: MixedReadings = Field(default_factory=MixedReadings, description="rag_qa: how passages are read.")

    @model_validator(mode="after")
    def _check(self) -> Source:
        if self.split == "test":
            raise ValueError(f"source {self.path}: split='test' is reserved for evaluation; train on 'train'")
        if self.dev_split == "test":
            raise ValueError(f"source {self.path}: dev_split='test' would tune on the test part; use 'dev'")
        return self


class Lengths(BaseModel):
    """Token budgets of the examples (paper Sec. 2.4: d, q, a of up to 512, 16 and 128 tokens)."""

    model_config = ConfigDict(extra="forbid")

    document: int = Field(512, ge=1, description="Tokens of a document (longer ones are cut).")
    query: int = Field(16, ge=1, description="Tokens of q in text continuation.")
    answer: int = Field(128, ge=1, description="Tokens of a in text continuation; longest answer/summary otherwise.")
    autoencoding: int = Field(256, ge=1, description="Longest passage to reconstruct.")
    min_document: int = Field(8, ge=1, description="Shorter documents are skipped (and counted).")

"""Pydantic configuration of an evaluation run (what `nugget-rag eval` parses its options into)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..config import PROBE_RATIO, Decoding, MergedFormat
from ..prompts import QA_PROMPT, check_template, takes_question

TASKS = ("autoencoding", "squad", "cnndm", "lm", "hotpotqa", "long_cnndm", "squad_rag", "hotpotqa_rag")
DEFAULT_FILES = {
    "autoencoding": "python-3.11-docs.jsonl",
    "squad": "squad-dev-v1.1.json",
    "cnndm": "cnndm-test-250.jsonl",
    "lm": "wikitext-2-raw-test.txt",
    "hotpotqa": "hotpotqa-dev-distractor-53.json",
    "long_cnndm": "cnndm-test-250.jsonl",
    "squad_rag": "squad-dev-v1.1.json",
    "hotpotqa_rag": "hotpotqa-dev-distractor-53.json",
    "speed": "python-3.11-docs.jsonl",
}
def all_systems() -> list[str]:
    """Every system registered in nugget_rag/eval/systems (a new one is included without further edits)."""
    from .systems import registered_systems

    return registered_systems()


class SpeedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    documents: list[int] = Field(default_factory=lambda: [1, 4, 16], description="Documents per question.")
    doc_tokens: int = Field(512, ge=8, description="Tokens per document.")
    repeats: int = Field(3, ge=1, description="Timed repeats after one warm-up (the median is reported).")
    decode_steps: int = Field(16, ge=2, description="Tokens generated to time per-token decoding.")
    policy: bool = Field(True, description="Also time the default resolution policy over stored states.")


class LMConfig(BaseModel):
    """Language modelling as in Table 1: [history compressed][context explicit][target scored]."""

    model_config = ConfigDict(extra="forbid")

    history: int = Field(640, ge=1, description="History tokens, compressed to ceil(history / r) states.")
    context: int = Field(64, ge=1, description="Explicit recent tokens after the history.")
    target: int = Field(64, ge=1, description="Tokens whose perplexity is measured.")


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(default_factory=lambda: ["squad"])
    systems: list[str] = Field(default_factory=all_systems)
    ratios: list[float] = Field(default_factory=lambda: [5.0, 10.0, 20.0])
    split: Literal["train", "dev", "test"] | None = Field("dev", description="Split of each file (splits.json); None: whole file.")
    task_splits: dict[str, Literal["train", "dev", "test"] | None] = Field(
        default_factory=dict, description="Per-task split overrides, e.g. {'hotpotqa': 'test'}.")
    data_dir: Path = Path("../shared/data")
    data: dict[str, Path] = Field(default_factory=dict, description="Per-task data files (default: DEFAULT_FILES in data_dir).")
    limit: int | None = Field(None, ge=1, description="At most this many examples per task.")
    task_limits: dict[str, int] = Field(default_factory=dict, description="Per-task limits, e.g. {'cnndm': 30}.")
    sample: Literal["first", "random"] = Field("first", description=(
        "Which examples a limit keeps (SQuAD, HotpotQA, CNN/DM): the file's first ones, or a random sample of the "
        "split drawn with sample_seed. SQuAD's file order groups questions by article: its first 200 dev questions "
        "are one article's."))
    sample_seed: int = Field(0, description="Seed of --sample random.")
    checkpoint: Path | Literal["default"] | None = Field(
        "default", description="Nugget checkpoint; 'default': the one shipped for the default model (untrained on "
                               "another base model); None: untrained adapters.")
    full_checkpoint: Path | None = None
    base_model: Path | None = None
    device: str | None = None
    dtype: str | None = None
    weights: MergedFormat = Field(
        "float", description="How the decoder adapter's passes run: int8 on a CPU (NuggetModel.merged_format).")
    decoding: Decoding = Field("dynamic", description="How generation decodes after the prompt (NuggetModel.decoding): "
                               "compiled records each step as a CUDA graph on CUDA.")
    threads: int | None = Field(None, ge=1)
    batch_size: int = Field(4, ge=1)
    qa_max_new_tokens: int = Field(64, ge=1, description="Paper App. E: at most 64 new tokens.")
    keep_ratio: float = Field(PROBE_RATIO, ge=1.0, description="The store floor of the resolution systems' compressor "
                              "(NuggetCompressor.keep_ratio): the finest ratio its stored states keep.")
    qa_finish_sentence: int = Field(0, ge=0, description="QA: past qa_max_new_tokens, up to this many more tokens to "
                                    "end the sentence the limit cut (GenerationSettings.finish_sentence; 0: the paper's hard limit).")
    qa_no_repeat_ngram_size: int = Field(0, ge=0, description="QA: never generate an n-gram of this size twice in "
                                         "an answer (GenerationSettings.no_repeat_ngram_size; 0: off, as the paper).")
    qa_repetition_penalty: float = Field(1.0, ge=1.0, allow_inf_nan=False, description="QA: "
                                         "GenerationSettings.repetition_penalty (1: off, as in the paper).")
    only_ids: list[str] | None = Field(None, description="Of the examples a task would evaluate (after its split, "
                                       "sample and limit), only those with these ids: reruns some answers of a run.")
    qa_prompt: str = Field(QA_PROMPT, description="QA instruction with a {question} placeholder (paper App. D).")
    summary_max_new_tokens: int = Field(128, ge=1)
    rag_passages: int = Field(4, ge=1, description="squad_rag: passages per question, the gold one and the "
                              "same-article paragraphs all-MiniLM-L6-v2 ranks closest to the question.")
    long_articles: int = Field(12, ge=2, description="long_cnndm: consecutive articles joined into one document "
                                                     "(12 make about 9,000 tokens, more than the default model's 8,192 positions).")
    ae_lengths: list[int] = Field(default_factory=lambda: [100, 200, 300, 400, 500],
                                  description="Autoencoding input lengths in tokens (Fig. 4 buckets).")
    ae_max_new_tokens: int | None = Field(None, ge=1, description="Reconstruction budget (default: 1.25 x length + 8).")
    lm: LMConfig = Field(default_factory=LMConfig)
    speed: SpeedConfig = Field(default_factory=SpeedConfig)
    optimal: bool = Field(False, description="Run the Scorer's greedy-optimal study (App. A) on the LM task.")
    optimal_examples: int = Field(4, ge=1)
    optimal_lm: LMConfig = Field(default_factory=lambda: LMConfig(history=128, context=64, target=64),
                                 description="LM window of the App. A study (the paper's: 128 / 64 / 64).")
    out_dir: Path | None = Field(None, description="Where results go (None: not written).")
    name: str = Field("eval", description="Stem of the result files.")
    plots: bool = True
    progress: bool = True
    write_benchmarks: Path | None = Field(None, description="Update this markdown file's harness section.")
    resume: bool = Field(False, description=(
        "Keep the results already in out_dir/name.json whose task setup (data, split, examples, checkpoints, "
        "dtype, generation settings) equals this run's, and compute only the missing (task, system, ratio) cells."))
    command: str = ""

    @field_validator("qa_prompt")
    @classmethod
    def _check_qa_prompt(cls, value: str) -> str:
        if not takes_question(check_template(value)):
            raise ValueError(f"qa_prompt {value!r} has no {{question}} placeholder: the question would be dropped")
        return value

    @field_validator("ratios")
    @classmethod
    def _ratios(cls, value: list[float]) -> list[float]:
        if not value:
            raise ValueError("give at least one compression ratio")
        for r in value:
            if not math.isfinite(r) or r < 1:
                raise ValueError(f"a compression ratio must be a finite number >= 1, got {r}")
        return sorted({float(r) for r in value})

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, value: list[str]) -> list[str]:
        unknown = [t for t in value if t not in (*TASKS, "speed")]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; choose from {', '.join((*TASKS, 'speed'))}")
        return list(dict.fromkeys(value))

    @field_validator("task_limits")
    @classmethod
    def _task_limits(cls, value: dict[str, int]) -> dict[str, int]:
        for task, n in value.items():
            if task not in TASKS:
                raise ValueError(f"--task-limit names unknown task {task!r}; choose from {', '.join(TASKS)}")
            if n < 1:
                raise ValueError(f"--task-limit {task}={n}: a limit must be >= 1")
        return value

    @model_validator(mode="after")
    def _systems(self) -> EvalConfig:
        from .systems import SYSTEMS

        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown:
            raise ValueError(f"unknown system(s) {unknown}; registered: {', '.join(sorted(SYSTEMS))}")
        self.systems = list(dict.fromkeys(self.systems))
        return self

    def qa_generation(self) -> dict[str, float]:
        """The GenerationSettings fields that QA answers take from this run (beyond greedy and the token limit)."""
        return {"finish_sentence": self.qa_finish_sentence, "no_repeat_ngram_size": self.qa_no_repeat_ngram_size,
                "repetition_penalty": self.qa_repetition_penalty}

    def data_file(self, task: str) -> Path:
        return Path(self.data.get(task) or self.data_dir / DEFAULT_FILES[task])

    def split_for(self, task: str):
        return self.task_splits.get(task, self.split)

    def limit_for(self, task: str) -> int | None:
        return self.task_limits.get(task, self.limit)

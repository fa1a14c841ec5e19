"""Pydantic configuration of a training run: data sources (sources.py), optimisation, checkpoints, logging."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..config import NuggetConfig, StreamSettings
from .objectives import check_source
from .sources import Lengths, Source


class Optimizer(BaseModel):
    """AdamW with a warm-up and a cosine (or constant) schedule; defaults of the paper's Appendix B."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-4, gt=0)
    scorer_lr: float | None = Field(None, ge=0, description="Learning rate of the Scorer (default: lr; 0: the Scorer "
                                                           "keeps its weights, e.g. a warm start's).")
    soft_prompt_lr: float | None = Field(None, gt=0, description="Learning rate of the soft prompt (default: lr).")
    encoder_lr: float | None = Field(None, ge=0, description=(
        "Learning rate of the encoder adapter (default: lr; 0: it keeps its weights and is not differentiated; "
        "with scorer_lr 0 too, every state stored with the starting checkpoint stays valid: only the reader learns)."))
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(100, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping (None: off).")


class Distillation(BaseModel):
    """KL to the uncompressed teacher (KV-Distill): the frozen base model reading the documents' full text with the
    same prompt; the student is the decoder reading their nuggets. Every objective but the full-context reference."""

    model_config = ConfigDict(extra="forbid")

    weight: float = Field(0.0, ge=0, le=1, description="Share of the KL in the loss, (1 - w) CE + w KL (0: CE only).")
    direction: Literal["forward", "reverse", "both"] = Field(
        "forward", description="KL(teacher || student), KL(student || teacher), or their mean.")
    temperature: float = Field(1.0, gt=0, description="Both distributions softened by it (the KL scaled by T^2).")
    top_k: int | None = Field(None, ge=1, description="Forward KL over the teacher's top-k tokens only, both distributions "
                                                        "renormalised there (less memory).")
    teacher: str | None = Field(None, description="Teacher LLaMA directory (same tokenizer; default: the student's "
                                                  "own base model, adapters off).")
    positions: Literal["targets", "all"] = Field(
        "targets", description="Where the KL compares the two: at the target tokens only, or at every decoder token "
        "after the documents, the prompt's as well (KV-Distill; more signal per example). Autoregressive mode always "
        "compares every token that reads nuggets.")

    @model_validator(mode="after")
    def _check(self) -> Distillation:
        if self.top_k is not None and self.direction != "forward":
            raise ValueError(f"distill.top_k needs direction='forward' (got {self.direction!r}): the reverse KL needs "
                             "the teacher's whole distribution")
        return self


class RatioCurriculum(BaseModel):
    """Compression ratio per micro-batch (Activation Beacon): log-uniform in [low, high], or drawn uniformly from a
    small discrete set (`choices`: each ratio a fixed nugget budget, so a compiled step sees a bounded number of
    shapes; Semi-Dynamic). `high` grows from `low` over `ramp_steps` (0: the whole range from the start); with
    `choices`, the ratios at or below the grown `high` are drawn. None (the default): nugget.ratio throughout."""

    model_config = ConfigDict(extra="forbid")

    low: float | None = Field(None, ge=1, description="Smallest ratio sampled (default: the smallest choice).")
    high: float | None = Field(None, ge=1, description="Largest ratio sampled once the ramp is over (default: the "
                                                       "largest choice).")
    choices: list[float] | None = Field(None, min_length=1, description="A discrete set of ratios, drawn uniformly "
                                                                        "(None: log-uniform in [low, high]).")
    ramp_steps: int = Field(0, ge=0, description="Steps over which the largest ratio grows from low to high.")

    @model_validator(mode="after")
    def _check(self) -> RatioCurriculum:
        if self.choices is not None:
            if any(r < 1 for r in self.choices):
                raise ValueError(f"ratios.choices={self.choices} holds a ratio below 1; every ratio must be >= 1")
            if (self.low, self.high) != (None, None):
                raise ValueError(f"give ratios.choices={self.choices} or ratios.low/high "
                                 f"({self.low}, {self.high}), not both")
            self.choices = sorted(set(self.choices))
            self.low, self.high = self.choices[0], self.choices[-1]
        elif self.low is None or self.high is None:
            raise ValueError("ratios needs low and high (a log-uniform range) or choices (a discrete set)")
        if self.high < self.low:
            raise ValueError(f"ratios.high={self.high} is below ratios.low={self.low}; give low <= high")
        return self


WarmStartSignal = Literal["observed_attention", "kvzip", "answers"]


class ScorerWarmStart(BaseModel):
    """Before training, fit the Scorer to where a document's information lies: a training-free importance signal of
    the frozen model (the attention its later tokens pay each position, H2O's observed attention; or the most
    attention a position gets while the model repeats the document, KVzip), or the tokens of the short answers the
    QA sources' questions have in it (`answers`: question-agnostic salience, the facts a question asks for)."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(0, ge=0, description="Scorer-only steps before step 0 (0: no warm start).")
    lr: float = Field(1e-3, gt=0, description="Learning rate of the warm start.")
    signal: WarmStartSignal = Field("observed_attention", description="The importance signal the Scorer fits.")
    answer_tokens: int = Field(16, ge=1, description="signal 'answers': a reference of more tokens than this is not "
                               "a span to keep (a teacher's sentence-long answer), only shorter ones are.")
    blend_scorer: str | None = Field(None, description=(
        "signal 'answers': a nugget checkpoint whose Scorer (one trained end to end, as the pretraining chain's "
        "through Eq. 18) is the reconstruction signal blended in: a QA document's target is (1 - blend_share) x its "
        "answers' tokens + blend_share x that Scorer's order (a mass falling by e every n / ratio ranks), and every "
        "other source's documents fit that order alone, so the positions answers do not claim keep the order "
        "reconstruction learned. "
        "None: the answers alone, on QA documents."))
    blend_share: float = Field(0.5, gt=0, lt=1, description="The blend_scorer's share of a QA document's target.")
    at_branch: bool = Field(False, description=(
        "Fit also where a branch (branch_from) begins, refitting the Scorer of the run it branches from (an A/B arm "
        "of the warm start); otherwise only a chain's first call fits it."))

    @model_validator(mode="after")
    def _blend_with_answers(self) -> ScorerWarmStart:
        if self.blend_scorer is not None and self.signal != "answers":
            raise ValueError(f"scorer_warm_start.blend_scorer blends a Scorer into the answers' targets, and signal is "
                             f"{self.signal!r}: set signal: answers, or leave blend_scorer unset")
        return self


class TrainConfig(BaseModel):
    """Everything a run needs; saved beside its checkpoints, and compared on resume."""

    model_config = ConfigDict(extra="forbid")

    output_dir: Path = Field(description="Checkpoints, metrics, plots and the final export go here.")
    base_model: str | None = Field(None, description="Base LLaMA checkpoint directory (default: SmolLM2-135M-Instruct).")
    init_from: str | None = Field(None, description="Nugget checkpoint to start from (e.g. a pretraining run's "
                                                    "export; 'default': the one shipped for SmolLM2-135M-Instruct).")
    branch_from: str | None = Field(None, description=(
        "A checkpoint of another run (its checkpoint-N folder) to begin at: its parts, optimiser state, schedule "
        "position, step and lineage, with this run's own data and recipe, the streams starting afresh. For an A/B of "
        "data mixes from one point of a run; a resumed branch reads its own checkpoint."))
    nugget: NuggetConfig = Field(default_factory=NuggetConfig, description="Ratio, Scorer and LoRA settings.")
    data: list[Source] = Field(min_length=1)
    lengths: Lengths = Field(default_factory=Lengths)
    ready_dir: str | None = Field(None, description="A folder of ready sets (`--write-ready`; ready.py): each source "
                                                     "split with one there loads it instead of tokenising.")
    stream: StreamSettings = Field(default_factory=StreamSettings,
                                   description="Autoregressive mode's window and segments (language_modeling).")
    distill: Distillation = Field(default_factory=Distillation)
    ratios: RatioCurriculum | None = Field(None, description="Ratio curriculum (default: nugget.ratio throughout).")
    scorer_warm_start: ScorerWarmStart = Field(default_factory=ScorerWarmStart)
    optim: Optimizer = Field(default_factory=Optimizer)
    batch_size: int = Field(4, ge=1, description="Examples per micro-batch (per process).")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimiser step.")
    group_by_length: int = Field(0, ge=0, description="Draw this many micro-batches of a source at once and batch "
                                                     "examples of similar lengths together (less padding; 0: off).")
    max_steps: int = Field(1000, ge=0, description="Optimiser steps (the schedule spans them; 0: only the Scorer "
                                                   "warm start, then the export). With `chain`: the whole chain's "
                                                   "updates, this run training what the chain has not.")
    chain: bool = Field(False, description=(
        "Continue the chain of init_from's export (lineage.py): the learning-rate schedule goes on from the chain's "
        "updates (no second warm-up; the cosine spans max_steps over the whole chain), and a config of another "
        "stage (objectives, lengths, nugget settings but the ratio) is refused. false: this run begins a chain. "
        "The optimiser state restarts unless output_dir holds a checkpoint (then the run resumes from it)."))
    max_time: float | None = Field(None, gt=0, description="Stop (with a checkpoint) after this many seconds, counted "
                                                        "from the start of setup (loading, tokenising).")
    eval_every: int = Field(100, ge=0, description="Steps between dev evaluations (0: only at the end).")
    eval_examples: int = Field(32, ge=1, description="Dev examples per source in an evaluation.")
    eval_ratios: list[float] = Field(default_factory=list, description="Ratios at which each source's dev loss is "
                                     "also measured, beside nugget.ratio's (SOURCE@rR/loss; e.g. [2] watches "
                                     "reconstruction at r = 2 while the decision measures it).")
    eval_generate: int = Field(0, ge=0, description="Dev examples per source also generated and scored "
                                                    "(autoencoding BLEU, QA accuracy, summarisation ROUGE-L).")
    save_every: int = Field(100, ge=1, description="Steps between checkpoints.")
    export_every: int = Field(0, ge=0, description="Also export a candidate at every multiple of this many updates of "
                                                   "the chain (output_dir/export-UPDATE, as the final export is "
                                                   "written; 0: only the final one).")
    keep_last: int = Field(3, ge=1, description="Checkpoints kept.")
    log_every: int = Field(10, ge=1, description="Steps between metric lines.")
    seed: int = 0
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 on GPU, else no. bf16 also speeds up CPUs with native bf16 (AVX512-BF16, AMX)."
    )
    gradient_checkpointing: bool = False
    compile: Literal["off", "layers", "step"] = Field(
        "off", description="layers: torch.compile each layer of the base model (dynamic shapes; attention stays eager), "
                           "which fuses the element-wise operations of the norms, rotary embeddings, LoRA and MLP. "
                           "step: the whole step of objectives with fixed widths (autoencoding, continuation) in one "
                           "graph per objective and batch size, any ratio, and the optimiser's update "
                           "(compiled_step.py): "
                           "for GPUs, where the step is bound by Python launching kernels. The first steps of each "
                           "pay the compilation; no faster on a CPU (BENCHMARKS.md). true means layers.",
    )

    compile_backend: str = Field("inductor", description="torch.compile's backend for compile: step (aot_eager: "
                                                         "trace and check without generating code, as CPU rehearsals "
                                                         "do).")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile's mode for compile: step: reduce-overhead replays each graph as a CUDA "
                               "graph (one launch a graph instead of one a kernel).")

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_flag(cls, value):
        return {True: "layers", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _compiled_step_alone(self) -> TrainConfig:
        if self.compile == "step" and self.gradient_checkpointing:
            raise ValueError("compile: step with gradient_checkpointing: a checkpointed layer's replay switches the "
                             "adapters, which a compiled graph cannot; turn gradient_checkpointing off (the "
                             "pretraining step fits without it) or use compile: layers")
        return self

    @model_validator(mode="after")
    def _answers_from_qa(self) -> TrainConfig:
        warm = self.scorer_warm_start
        if warm.steps and warm.signal == "answers" and not any(s.objective == "qa" and not s.full_context
                                                                for s in self.data):
            raise ValueError("scorer_warm_start.signal='answers' fits the Scorer to the answers of QA sources, and "
                             "the run has none: add a qa source (its documents and short answers), or set steps: 0")
        return self

    attention: Literal["auto", "fused", "reference"] = Field(
        "auto", description="How the decoder attends to nuggets in training: fused (the Eq. 18 bias in an extra "
                            "query/key channel, no float mask, so SDPA's fused kernels run), reference (under a float "
                            "mask), auto (fused on CUDA). Both give the same loss and gradients.",
    )
    packing: bool = Field(
        False, description="Pack the documents of a micro-batch several to a row of the encoder's passes (the "
                           "Scorer's and the encoder's), each attending to itself alone at positions from 0, instead "
                           "of one to a row padded to the longest: the same nuggets, loss and gradients from fewer "
                           "positions (packing.py). The decoder's pass stays one example to a row.",
    )
    export_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Weights of the final export (bfloat16: half the size; checkpoints stay float32)."
    )
    cpu: bool = Field(False, description="Train on the CPU even when a GPU is present.")
    threads: int | None = Field(None, ge=1, description="CPU threads for torch (default: torch's choice).")
    peak_tflops: float | None = Field(None, gt=0, description="The accelerator's peak TFLOP/s, for the logged model-FLOPs "
                                                             "utilisation (default: A100, H100 and H200 are known).")

    @field_validator("data")
    @classmethod
    def _registered_objectives(cls, sources: list[Source]) -> list[Source]:
        for source in sources:
            check_source(source)
        return sources

    @field_validator("eval_ratios")
    @classmethod
    def _eval_ratios(cls, ratios: list[float]) -> list[float]:
        return [NuggetConfig(ratio=r).ratio for r in ratios]  # each checked as the model's ratio is

    @field_validator("max_time", mode="before")
    @classmethod
    def _duration(cls, value: object) -> object:
        """Accept seconds or '90m', '2h', '1h30m'."""
        if isinstance(value, str) and not re.fullmatch(r"\d+(\.\d+)?", value.strip()):
            parts = re.fullmatch(r"\s*(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s)?\s*", value)
            if not parts or not any(parts.groups()):
                raise ValueError(f"max_time must be seconds or like '90m', '2h', '1h30m'; got {value!r}")
            h, m, s = (int(g or 0) for g in parts.groups())
            return h * 3600 + m * 60 + s
        return value

    def ratio_range(self) -> tuple[float, float]:
        """The smallest and largest compression ratio this run trains with."""
        return (self.ratios.low, self.ratios.high) if self.ratios else (self.nugget.ratio, self.nugget.ratio)

    def resume_key(self) -> dict:
        """The settings a resumed run must share with the run that wrote the checkpoint (init_from only shapes a
        run's start: a resumed one reads its own checkpoint). How a step is computed (compile, attention, gradient
        checkpointing) may change: the updates stay the same."""
        return self.model_dump(
            mode="json",
            exclude={"output_dir", "init_from", "branch_from", "max_steps", "max_time", "eval_every", "eval_examples",
                     "eval_ratios", "eval_generate", "save_every", "export_every", "keep_last", "log_every", "threads", "cpu", "export_dtype", "peak_tflops",
                     "compile", "compile_backend", "compile_mode", "attention", "packing", "ready_dir",
                     "gradient_checkpointing"},
        )

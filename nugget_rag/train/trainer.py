"""The training loop: Accelerate for devices and distribution; each step's micro-batches, backward passes and update;
evaluation, checkpoints and metrics at their intervals (their jobs in run_data.py, optimisation.py, evaluation.py,
resume.py and metrics.py)."""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs, DistributedType
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from ..model.base_model import load_base_model
from ..model.nugget_model import NuggetModel
from . import lineage
from .batches import Batch, Mixture
from .compiled_step import CompiledStep, compile_layers
from .config import TrainConfig
from .data import ExampleStream
from .distill import Teacher
from .evaluation import dev_scores
from .flops import peak_flops
from .loss import ObjectiveLoss
from .metrics import MetricsFile, Window, plot
from .optimisation import build_optimizer, build_scheduler, curriculum_ratio
from .resume import (
    CONFIG_FILE,
    FINAL_DIR,
    check_resume,
    export,
    restore,
    save,
    start_from,
    start_point,
    training_record,
)
from .run_data import run_data, source_names
from .stopping import StopRequests
from .warm_start import warm_start_scorer

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    step: int
    output_dir: Path
    final_dir: Path
    losses: list[dict] = field(default_factory=list)  # the train metric lines of this process


class Trainer:
    """Trains a NuggetModel on a mixture of objectives; see TrainConfig for every setting."""

    def __init__(self, config: TrainConfig, model: NuggetModel | None = None):
        self.created = time.monotonic()  # max_time counts from here: loading and tokenising are part of a bounded call
        self.config = config
        self.out = Path(config.output_dir)
        handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)]
        trackers = "tensorboard" if importlib.util.find_spec("tensorboard") else None
        self.accelerator = Accelerator(cpu=config.cpu, mixed_precision=self._precision(), log_with=trackers,
                                       project_dir=str(self.out), kwargs_handlers=handlers)
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise NotImplementedError("DeepSpeed runs are not supported yet (their optimiser state is partitioned); "
                                      "use DDP: accelerate launch --multi_gpu -m nugget_rag.train ...")
        if config.threads:
            torch.set_num_threads(config.threads)
        set_seed(config.seed)
        check_resume(config, self.out)
        if model is None:
            model = NuggetModel.from_pretrained(None, base_model=config.base_model, device=self.accelerator.device,
                                                dtype=torch.float32, config=config.nugget)
        elif model.config != config.nugget:
            raise ValueError(f"the model's nugget settings {model.config.model_dump()} differ from the config's "
                             f"{config.nugget.model_dump()}; pass the same settings")
        else:
            model.to(self.accelerator.device)
        self.earlier = start_from(config, model, self.out)  # the lineage this run continues (lineage.py)
        self.offset = lineage.chain_updates(self.earlier) if config.chain else 0  # the schedule's first step
        # each call of a chain draws its own data order and ratios (a resumed call the same ones again)
        self.data_seed = config.seed + self.offset
        if self.offset and self.offset >= config.max_steps:
            raise ValueError(f"chain: init_from's chain already holds {self.offset} updates and max_steps="
                             f"{config.max_steps} counts the whole chain's; raise max_steps above {self.offset}")
        self.updates = config.max_steps - self.offset  # this run's
        if config.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        if config.compile == "layers":
            compile_layers(model)
        model.attention = config.attention
        self.model = model
        self.compiled = None
        if config.compile == "step":
            if self.accelerator.mixed_precision == "fp16":
                raise ValueError("compile: step updates without fp16's gradient scaler; use mixed_precision bf16 or no")
            fused = config.attention == "fused" or (config.attention == "auto" and self.accelerator.device.type == "cuda")
            self.compiled = CompiledStep(model, config.data, config.lengths, config.ratio_range()[0], fused,
                                         config.compile_backend, config.compile_mode)
        self.teacher = self._teacher() if config.distill.weight > 0 else None
        self.names = source_names(config.data)
        data = run_data(config, model, self.names, self.teacher.max_positions if self.teacher else None,
                        self.data_seed, self.out / "cache", self.accelerator)
        self.mixture, self.dev, self.examples, self.data_lines = data
        self.optimizer = build_optimizer(config.optim, model, compiled=self.compiled is not None)
        self.scheduler = build_scheduler(self.optimizer, config.optim, config.max_steps, self.offset)
        self.objective = ObjectiveLoss(model, config.data, config.distill, self.teacher, config.stream,
                                       train_encoder=config.optim.encoder_lr != 0, packing=config.packing,
                                       compiled=self.compiled)
        self.loss, self.optimizer = self.accelerator.prepare(self.objective, self.optimizer)
        self.metrics = MetricsFile(self.out, self.accelerator)
        self.step = 0
        self.branched = False  # set by _resume: this run begins at another run's checkpoint (branch_from)
        self.tokens_before: int | None = 0  # tokens the run had read when its checkpoint was saved (None: unknown)
        self.tokens = 0  # tokens this process has read since
        self.passes = 1  # forward/backward passes per micro-batch: doubled when one runs out of GPU memory
        if trackers:
            self.accelerator.init_trackers("nugget-rag")

    def _precision(self) -> str:
        if self.config.mixed_precision != "auto":
            return self.config.mixed_precision
        gpu = torch.cuda.is_available() and not self.config.cpu
        return "bf16" if gpu and torch.cuda.is_bf16_supported() else "no"

    def _teacher(self) -> Teacher:
        path = self.config.distill.teacher
        if path is None:
            return Teacher(self.model)
        return Teacher(self.model, load_base_model(path, device=self.accelerator.device, dtype=torch.float32))

    # ------------------------------------------------------------------ loop
    def train(self) -> TrainResult:
        cfg, acc = self.config, self.accelerator
        self.out.mkdir(parents=True, exist_ok=True)
        self._resume()
        for line in self.data_lines:
            self.metrics.write(line)
        if acc.is_main_process:
            (self.out / CONFIG_FILE).write_text(json.dumps(cfg.resume_key(), indent=1))
        start, losses, window = time.monotonic(), [], Window(peak_flops(acc.device, cfg.peak_tflops), cfg.packing)
        if (self.step == 0 and not self.offset) or (self.branched and cfg.scorer_warm_start.at_branch):
            self._warm_start()  # where a chain (or an arm refitting it) begins; a chain's later call keeps its Scorer
        bar = tqdm(total=self.updates, initial=self.step, desc="training", disable=not acc.is_local_main_process)
        if self.step == 0 and cfg.eval_every:
            self.evaluate()  # the starting point, for the before/after comparison
        self.model.train()
        stopped, first = False, self.step + 1
        with StopRequests() as stops:
            while self.step < self.updates:
                tick = time.monotonic()
                batches = []
                for _ in range(cfg.grad_accum):
                    ratio = self._ratio()
                    batches.append(self.mixture.next_batch())
                    batches[-1].ratio = ratio
                for batch, (loss, terms, flops) in zip(batches, self._backward(batches)):
                    window.add(self.names[batch.source], loss, batch, terms, flops)
                    self.tokens += batch.tokens
                if self.compiled is not None:
                    self.compiled.update(self.optimizer.optimizer, self.scheduler, cfg.optim.max_grad_norm)
                else:
                    if cfg.optim.max_grad_norm:
                        acc.clip_grad_norm_(self.model.parameters(), cfg.optim.max_grad_norm)
                    self.optimizer.step()
                    self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                if self.step == first:  # this call's setup: loading, tokenising, compiling, the first update
                    self.metrics.write({"kind": "setup", "step": self.step,
                                        "first_update_s": round(time.monotonic() - self.created, 1)})
                window.seconds += time.monotonic() - tick
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == self.updates:
                    line = {"kind": "train", "step": self.step, "lr": float(self.scheduler.get_last_lr()[0]), **window.flush(),
                            "passes": self.passes, "elapsed_s": round(time.monotonic() - start, 1)}
                    if self.compiled is not None:  # graphs compiled so far: one a bucket, and the update's (CompiledStep)
                        line |= {"buckets": len(self.compiled.buckets), "loss_graphs": self.compiled.graphs["loss"],
                                 "update_graphs": self.compiled.graphs["update"]}
                    losses.append(line)
                    self.metrics.write(line)
                    bar.set_postfix({k[5:]: f"{v:.3f}" for k, v in line.items() if k.startswith("loss/")})
                timed_out = cfg.max_time is not None and time.monotonic() - self.created > cfg.max_time
                stopping = self._all_agree(timed_out or stops.requested is not None)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and not stopping:
                    self.evaluate()
                if self.step % cfg.save_every == 0 or stopping or self.step == self.updates:
                    self._save()
                if cfg.export_every and (self.offset + self.step) % cfg.export_every == 0 and self.step < self.updates:
                    self._export(f"export-{self.offset + self.step}")
                if stopping:
                    stopped = True
                    log.info("%s at step %d: checkpointed; re-run the same command to resume",
                             "max_time reached" if timed_out else stops.requested, self.step)
                    break
        bar.close()
        if not stopped and (not cfg.eval_every or self.step % cfg.eval_every):
            self.evaluate()
        final = self._export(FINAL_DIR)
        if acc.is_main_process:
            self.plot()
        acc.end_training()
        return TrainResult(self.step, self.out, final, losses)

    def _backward(self, batches: list[Batch]) -> list[tuple[float, dict[str, float], float | None]]:
        """Backpropagate one step's micro-batches, each cut into `self.passes` passes, each pass weighted by its share
        of the targets: the gradient of the micro-batches' mean loss. When a pass runs out of GPU memory (one
        process), the step's gradients are dropped and it starts again in twice the passes: the same examples and
        gradient at less memory, and every later step keeps the smaller passes. Returns each micro-batch's loss,
        loss terms and model FLOPs."""
        acc = self.accelerator
        while True:
            try:
                return [self._backward_passes(batch, last=i == len(batches) - 1, scale=1 / len(batches))
                        for i, batch in enumerate(batches)]
            except torch.OutOfMemoryError:
                largest = max(len(batch.documents) for batch in batches)
                if acc.num_processes > 1 or self.passes >= largest:
                    raise
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            self.passes *= 2
            log.warning("out of GPU memory at step %d: each micro-batch now runs in %d passes (at most %d examples "
                        "each; batch_size %d stays the step's batch)", self.step, self.passes,
                        -(-largest // self.passes), self.config.batch_size)

    def _backward_passes(self, batch: Batch, last: bool, scale: float) -> tuple[float, dict[str, float], float | None]:
        acc = self.accelerator
        parts = batch.split(self.passes)
        total, loss_value, terms, flops = batch.targets, 0.0, defaultdict(float), 0.0
        for i, part in enumerate(parts):
            weight = part.targets / total
            sync = last and i == len(parts) - 1
            with acc.no_sync(self.loss) if not sync and acc.num_processes > 1 else nullcontext():
                loss = self.loss(part)
                acc.backward(loss * (weight * scale))
            loss_value += loss.detach().item() * weight
            for term, value in self.objective.terms.items():
                terms[term] += value * weight
            flops = None if flops is None or self.objective.flops is None else flops + self.objective.flops
        return loss_value, dict(terms), flops

    def _ratio(self) -> float | None:
        """The next micro-batch's compression ratio under the curriculum (None without one: the model's)."""
        return curriculum_ratio(self.config.ratios, self.step, self.data_seed, self.mixture.draws)

    def _warm_start(self) -> None:
        """The Scorer warm start, on documents of every source that has some, in an order of its own."""
        cfg = self.config
        warm = cfg.scorer_warm_start
        answers_only = warm.signal == "answers" and warm.blend_scorer is None
        kept = [i for i, s in enumerate(cfg.data) if not s.full_context and (not answers_only or s.objective == "qa")]
        if not warm.steps or not kept:
            return
        streams = [ExampleStream(self.examples[i], seed=cfg.seed * 1000 + i + 500) for i in kept]
        batches = Mixture(streams, [cfg.data[i].weight for i in kept], cfg.seed + 1, cfg.batch_size,
                          self.model.tokenizer.pad_token_id)
        self.model.train()
        qa = {j for j, i in enumerate(kept) if cfg.data[i].objective == "qa"}
        losses = warm_start_scorer(self.model, batches, warm, qa)
        if losses:
            self.metrics.write({"kind": "warm_start", "step": self.step, "steps": len(losses), "signal": warm.signal,
                                **({"blend_scorer": warm.blend_scorer, "blend_share": warm.blend_share}
                                   if warm.blend_scorer else {}),
                                "kl_first": float(f"{losses[0]:.4g}"), "kl_last": float(f"{losses[-1]:.4g}")})

    def _all_agree(self, flag: bool) -> bool:
        """Whether any process raised `flag` (a collective where there are several: all stop at the same update)."""
        if self.accelerator.num_processes == 1:
            return flag
        return bool(self.accelerator.reduce(torch.tensor(int(flag), device=self.accelerator.device), "sum") > 0)

    def _read_tokens(self) -> int | None:
        """Tokens the run has read, over all processes (a collective: every process calls it)."""
        read = int(self.accelerator.reduce(torch.tensor(self.tokens, device=self.accelerator.device), "sum"))
        return None if self.tokens_before is None else self.tokens_before + read

    def _resume(self) -> None:
        found, self.branched = start_point(self.config, self.out)
        if found is None:
            return
        meta = restore(found, self.model, self.optimizer, self.scheduler, self.mixture, self.accelerator,
                       self.compiled is not None, self.config.max_steps, data=not self.branched)
        self.step = meta["step"]
        self.tokens_before = meta.get("tokens")  # None: saved before tokens were counted
        self.metrics.truncate(self.step)
        log.info("%s %s at step %d", "branched (this run's data) from" if self.branched else "resumed from", found,
                 self.step)

    def _save(self) -> None:
        self.accelerator.wait_for_everyone()
        tokens = self._read_tokens()
        if self.accelerator.is_main_process:
            save(self.config, self.out, self.step, self.model, self.optimizer, self.scheduler, self.mixture,
                 self.accelerator, tokens, self.earlier)

    def _export(self, name: str) -> Path:
        """The trained parts as they are now, with their training record, as output_dir/`name`."""
        tokens = self._read_tokens()
        if self.accelerator.is_main_process:
            export(self.out, self.model, self.config.export_dtype, self.training_record(tokens), name)
        return self.out / name

    def training_record(self, tokens: int | None) -> dict:
        """How the exported parts were trained (resume.training_record)."""
        return training_record(self.config, self.step, self.names, self.earlier, tokens, self.accelerator)

    def evaluate(self) -> dict:
        """Dev loss of every source (and generation scores for `eval_generate` examples)."""
        line = dev_scores(self.config, self.model, self.loss, self.objective, self.names, self.dev, self.step)
        self.metrics.write(line)
        log.info("eval at step %d: %s", self.step, {k: v for k, v in line.items() if "/" in k})
        return line

    def plot(self) -> Path | None:
        """The run's loss and dev scores as loss.png (metrics.plot)."""
        return plot(self.out)


def train(config: TrainConfig, model: NuggetModel | None = None) -> TrainResult:
    """Run (or resume) training as configured; returns where the final export went."""
    return Trainer(config, model).train()

"""The training loop: Accelerate for devices and distribution, checkpoints that resume exactly, metrics and plots."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import shutil
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, DistributedDataParallelKwargs, DistributedType
from accelerate.utils import set_seed
from datasets import Dataset
from pydantic import TypeAdapter
from tqdm.auto import tqdm

from ..config import DECODER, ENCODER, NuggetConfig
from ..generation.decoding import GenerationSettings, generate
from ..model.base_model import load_base_model
from ..model.checkpoint_files import DEFAULT_CHECKPOINT, checkpoint_config, default_checkpoint_for, read_checkpoint_meta
from ..model.nugget_model import NuggetModel
from ..state.files import write_atomic
from . import checkpoint, lineage
from .compiled_step import CompiledStep, compile_layers, tensor_learning_rates
from .config import TrainConfig
from .data import Batch, ExampleBuilder, ExampleStream, Mixture, build_examples, collate
from .distill import Teacher
from .flops import peak_flops
from .loss import ObjectiveLoss, compress_batch
from .objectives import OBJECTIVES
from .ready import find_ready, load_ready, ready_name, write_ready
from .sources import Source
from .warm_start import warm_start_scorer

log = logging.getLogger(__name__)

CONFIG_FILE = "train_config.json"
RECIPE = {"distill", "ratios", "scorer_warm_start"}  # settings a resumed run may change (with a warning)
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
LOSS_TERMS = {"loss", "ce", "kl"}  # what an eval line reports beside the generation scores
FINAL_DIR = "final"


@dataclass
class TrainResult:
    step: int
    output_dir: Path
    final_dir: Path
    losses: list[dict] = field(default_factory=list)  # the train metric lines of this process


def source_names(sources: list[Source]) -> list[str]:
    names = []
    for source in sources:
        name = f"{'full_context' if source.full_context else source.objective}:{Path(source.path).stem}"
        names.append(name if name not in names else f"{name}#{len(names)}")
    return names


def held_out(source: Source) -> Source:
    """The source its dev examples are read from (`dev_path`, else the source itself)."""
    return source.model_copy(update={"path": source.dev_path}) if source.dev_path else source


def example_builder(config: TrainConfig, source: Source, tokenizer, max_positions: int,
                    teacher_positions: int | None) -> ExampleBuilder:
    """The example builder of a source, as a run of `config` on a model of `max_positions` uses it."""
    return ExampleBuilder(source, tokenizer, config.lengths, max_positions, config.ratio_range()[0], config.seed,
                          in_user_turn=config.nugget.placement == "in_user_turn", teacher_positions=teacher_positions,
                          original_positions=config.nugget.nugget_positions == "original")


def load_ready_sets(config: TrainConfig, builders: list[ExampleBuilder], names: list[str]) -> dict:
    """(source index, split) -> (examples, skip counts) of each ready set in `config.ready_dir` (ready.py)."""
    found = {}
    for i, (source, builder, name) in enumerate(zip(config.data, builders, names)):
        for split in (source.split, source.dev_split):
            folder = find_ready(config.ready_dir, name, split) if split and not source.streaming else None
            if folder is not None:
                found[(i, split)] = load_ready(folder, builder, split)
    if config.ready_dir is not None:
        log.info("ready sets from %s: %s", config.ready_dir,
                 ", ".join(f"{names[i]} {split}" for i, split in found) or "none matched (every split is tokenised)")
    return found


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
        self._check_resume()
        if model is None:
            model = NuggetModel.from_pretrained(None, base_model=config.base_model, device=self.accelerator.device,
                                                dtype=torch.float32, config=config.nugget)
        elif model.config != config.nugget:
            raise ValueError(f"the model's nugget settings {model.config.model_dump()} differ from the config's "
                             f"{config.nugget.model_dump()}; pass the same settings")
        else:
            model.to(self.accelerator.device)
        self.earlier: list[dict] = []  # the lineage this run continues (lineage.py)
        if config.init_from:
            start = _init_checkpoint(config.init_from, model)
            trained_with = checkpoint_config(start)
            if trained_with.placement != model.config.placement:
                log.warning("init_from %s was trained with placement=%s; this run trains placement=%s (set "
                            "nugget.placement to keep the checkpoint's)", start, trained_with.placement,
                            model.config.placement)
            _check_lora(start, trained_with, model.config)
            self.earlier = lineage.earlier(read_checkpoint_meta(start))
            if config.chain:
                lineage.check_stage(self.earlier, lineage.stage_of(config), start)
            model.load_parts(start)
        found = checkpoint.latest(self.out)
        if found is not None:  # a resumed run continues the lineage it began with
            self.earlier = checkpoint.read_state(found).get("lineage", self.earlier)
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
        self.mixture, self.dev = self._data()
        self.optimizer = self._optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.objective = ObjectiveLoss(model, config.data, config.distill, self.teacher, config.stream,
                                       train_encoder=config.optim.encoder_lr != 0, packing=config.packing,
                                       compiled=self.compiled)
        self.loss, self.optimizer = self.accelerator.prepare(self.objective, self.optimizer)
        self.step = 0
        self.tokens_before: int | None = 0  # tokens the run had read when its checkpoint was saved (None: unknown)
        self.tokens = 0  # tokens this process has read since
        self.passes = 1  # forward/backward passes per micro-batch: doubled when one runs out of GPU memory
        if trackers:
            self.accelerator.init_trackers("nugget-rag")

    # ------------------------------------------------------------------ setup
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

    def _check_resume(self) -> None:
        """A resumed run must keep the settings that shape its data and model; a changed recipe (distillation,
        ratios, warm start) is allowed, with a warning that names it."""
        saved = self.out / CONFIG_FILE
        if checkpoint.latest(self.out) is not None and saved.is_file():
            now = self.config.resume_key()
            defaults = self._defaults(set(now))
            before = defaults | {k: defaults[k] | v if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
                                 for k, v in json.loads(saved.read_text()).items()}
            differ = sorted(k for k in now if before.get(k) != now[k])
            changed = [k for k in differ if k in RECIPE]
            if changed:
                log.warning("resuming %s with another recipe: %s (was %s)", self.out,
                            ", ".join(f"{k}={json.dumps(now.get(k))}" for k in changed),
                            ", ".join(f"{k}={json.dumps(before.get(k))}" for k in changed))
            differ = [k for k in differ if k not in RECIPE]
            if differ:
                raise ValueError(
                    f"{self.out} holds checkpoints of a run with other settings ({', '.join(differ)} differ); "
                    "resume with the same settings, or choose another output_dir"
                )

    def _defaults(self, names: set[str]) -> dict:
        """The defaults of these settings: a setting added after a run began counts as its default there (a nested
        one too, such as optim.encoder_lr)."""
        fields = type(self.config).model_fields
        return {k: TypeAdapter(fields[k].annotation).dump_python(fields[k].get_default(call_default_factory=True),
                                                                 mode="json") for k in names if not fields[k].is_required()}

    def _data(self) -> tuple[Mixture, list]:
        cfg, tok = self.config, self.model.tokenizer
        cache = self.out / "cache"
        streams, dev = [], []
        teacher = self.teacher.max_positions if self.teacher else None
        builders = [example_builder(cfg, source, tok, self.model.max_positions, teacher) for source in cfg.data]
        ready = load_ready_sets(cfg, builders, self.names)  # every ready set checked before any tokenising
        self.examples: list = []  # each source's training examples (the Scorer warm start draws its own order)
        self.data_lines: list[dict] = []  # written to the metrics once a resume has trimmed them
        for i, (source, name, builder) in enumerate(zip(cfg.data, self.names, builders)):
            examples, skipped = ready.get((i, source.split)) or build_examples(source, source.split, builder, cache)
            self.examples.append(examples)
            count = "streamed" if skipped is None else len(examples)
            came = " (ready set)" if (i, source.split) in ready else ""
            log.info("%s: %s training examples%s; skipped %s", name, count, came, dict(skipped or {}) or "none")
            self.data_lines.append({"kind": "data", "source": name, "examples": count, "skipped": dict(skipped or {})})
            streams.append(ExampleStream(examples, seed=self.data_seed * 1000 + i))
            held = []
            if source.dev_split is not None:
                examples, _ = ready.get((i, source.dev_split)) or build_examples(held_out(source), source.dev_split,
                                                                                builder, cache)
                if isinstance(examples, Dataset):
                    held = [examples[j] for j in range(min(cfg.eval_examples, len(examples)))]
                else:
                    held = [e for e in examples.take(4 * cfg.eval_examples) if not e["skip"]][: cfg.eval_examples]
            dev.append(held)
        acc = self.accelerator
        mixture = Mixture(streams, [s.weight for s in cfg.data], self.data_seed, cfg.batch_size, tok.pad_token_id,
                          rank=acc.process_index, world=acc.num_processes, group_by_length=cfg.group_by_length)
        return mixture, dev

    def _optimizer(self) -> torch.optim.Optimizer:
        opt, model = self.config.optim, self.model
        adapters = (ENCODER, DECODER) if opt.encoder_lr is None else (DECODER,)
        groups = [
            {"params": [p for name in adapters for p in model.adapter_parameters(name)], "lr": opt.lr},
            {"params": list(model.scorer.parameters()), "lr": opt.lr if opt.scorer_lr is None else opt.scorer_lr},
            {"params": [model.soft_prompt], "lr": opt.soft_prompt_lr or opt.lr},
        ]
        if opt.encoder_lr:
            groups.append({"params": list(model.adapter_parameters(ENCODER)), "lr": opt.encoder_lr})
        optimizer = torch.optim.AdamW(groups, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
        if self.compiled is not None:
            tensor_learning_rates(optimizer)
        return optimizer

    def _ratio(self) -> float | None:
        """The next micro-batch's compression ratio under the curriculum (None without one: the model's)."""
        ratios = self.config.ratios
        if ratios is None:
            return None
        grown = min(1.0, self.step / ratios.ramp_steps) if ratios.ramp_steps else 1.0
        high = ratios.low * (ratios.high / ratios.low) ** grown
        u = np.random.default_rng([self.data_seed, 11, self.mixture.draws]).random()
        if ratios.choices is not None:
            reached = [r for r in ratios.choices if r <= high * (1 + 1e-9)]
            return float(reached[min(int(u * len(reached)), len(reached) - 1)])
        return float(ratios.low * (high / ratios.low) ** u)

    def _warm_start(self) -> None:
        """The Scorer warm start, on documents of every source that has some, in an order of its own."""
        cfg = self.config
        kept = [i for i, s in enumerate(cfg.data) if not s.full_context]
        if not cfg.scorer_warm_start.steps or not kept:
            return
        streams = [ExampleStream(self.examples[i], seed=cfg.seed * 1000 + i + 500) for i in kept]
        batches = Mixture(streams, [cfg.data[i].weight for i in kept], cfg.seed + 1, cfg.batch_size,
                          self.model.tokenizer.pad_token_id)
        self.model.train()
        warm = cfg.scorer_warm_start
        losses = warm_start_scorer(self.model, batches, warm.steps, warm.lr, warm.signal)
        if losses:
            self._metric({"kind": "warm_start", "step": 0, "steps": len(losses), "signal": warm.signal,
                          "kl_first": float(f"{losses[0]:.4g}"),
                          "kl_last": float(f"{losses[-1]:.4g}")})

    def training_record(self, tokens: int | None) -> dict:
        """How the exported parts were trained (written beside them): this run's settings, and the lineage with this
        run (which read `tokens`) as its last segment."""
        cfg, acc = self.config, self.accelerator
        run = lineage.segment(cfg, self.step, acc.num_processes, tokens, acc.device, lineage.sources(cfg))
        return {"steps": self.step, "ratios": list(cfg.ratio_range()), "objectives": self.names,
                "distill": cfg.distill.model_dump(mode="json") if cfg.distill.weight > 0 else None,
                "scorer_warm_start": cfg.scorer_warm_start.model_dump(mode="json"),
                **lineage.record([*self.earlier, run])}

    def _read_tokens(self) -> int | None:
        """Tokens the run has read, over all processes (a collective: every process calls it)."""
        read = int(self.accelerator.reduce(torch.tensor(self.tokens, device=self.accelerator.device), "sum"))
        return None if self.tokens_before is None else self.tokens_before + read

    def _lr_factor(self, step: int) -> float:
        warmup, total = self.config.optim.warmup_steps, self.config.max_steps
        step += self.offset
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if self.config.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))

    # ------------------------------------------------------------------ loop
    def train(self) -> TrainResult:
        cfg, acc = self.config, self.accelerator
        self.out.mkdir(parents=True, exist_ok=True)
        self._resume()
        for line in self.data_lines:
            self._metric(line)
        if acc.is_main_process:
            (self.out / CONFIG_FILE).write_text(json.dumps(cfg.resume_key(), indent=1))
        start, losses, window = time.monotonic(), [], _Window(peak_flops(acc.device, cfg.peak_tflops),
                                                                   cfg.packing)
        if self.step == 0:
            self._warm_start()
        bar = tqdm(total=self.updates, initial=self.step, desc="training", disable=not acc.is_local_main_process)
        if self.step == 0 and cfg.eval_every:
            self.evaluate()  # the starting point, for the before/after comparison
        self.model.train()
        stopped_by_time, first = False, self.step + 1
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
                self._metric({"kind": "setup", "step": self.step,
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
                self._metric(line)
                bar.set_postfix({k[5:]: f"{v:.3f}" for k, v in line.items() if k.startswith("loss/")})
            timed_out = cfg.max_time is not None and time.monotonic() - self.created > cfg.max_time
            if cfg.eval_every and self.step % cfg.eval_every == 0 and not timed_out:
                self.evaluate()
            if self.step % cfg.save_every == 0 or timed_out or self.step == self.updates:
                self._save()
            if timed_out:
                stopped_by_time = True
                log.info("max_time reached at step %d", self.step)
                break
        bar.close()
        if not stopped_by_time and (not cfg.eval_every or self.step % cfg.eval_every):
            self.evaluate()
        final, tokens = self.out / FINAL_DIR, self._read_tokens()
        if acc.is_main_process:
            staging = self.out / f".tmp-{FINAL_DIR}"
            shutil.rmtree(staging, ignore_errors=True)
            self.model.save_pretrained(staging, dtype=getattr(torch, cfg.export_dtype), training=self.training_record(tokens))
            checkpoint.publish(staging, final)
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

    def _resume(self) -> None:
        found = checkpoint.latest(self.out)
        if found is None:
            return
        self.model.load_parts(found)
        meta = checkpoint.load(found, self.optimizer, self.scheduler)
        if self.compiled is not None:
            tensor_learning_rates(self.optimizer)
        self.mixture.load_state_dict(meta["data"])
        if meta.get("scaler") and self.accelerator.scaler is not None:
            self.accelerator.scaler.load_state_dict(meta["scaler"])
        if meta.get("max_steps", self.config.max_steps) != self.config.max_steps:
            log.warning("resuming a run of max_steps=%d with max_steps=%d: the learning-rate schedule now spans the "
                        "new number of steps, so the rate changes from here on", meta["max_steps"],
                        self.config.max_steps)
        self.step = meta["step"]
        self.tokens_before = meta.get("tokens")  # None: saved before tokens were counted
        self._truncate_metrics(self.step)
        log.info("resumed from %s at step %d", found, self.step)

    def _save(self) -> None:
        self.accelerator.wait_for_everyone()
        tokens = self._read_tokens()
        if self.accelerator.is_main_process:
            scaler = self.accelerator.scaler
            state = {"data": self.mixture.state_dict(), "max_steps": self.config.max_steps, "tokens": tokens,
                     "lineage": self.earlier,
                     "scaler": scaler.state_dict() if scaler is not None else None}
            checkpoint.save(self.out, self.step, self.model, self.optimizer, self.scheduler, state,
                            self.config.keep_last)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Dev loss of every source (and generation scores for `eval_generate` examples)."""
        cfg, model = self.config, self.model
        was_training = model.training
        model.eval()
        line: dict = {"kind": "eval", "step": self.step}
        for index, (name, held) in enumerate(zip(self.names, self.dev)):
            if not held:
                continue
            totals: dict[str, float] = defaultdict(float)
            for start in range(0, len(held), cfg.batch_size):
                chunk = held[start : start + cfg.batch_size]
                self.loss(collate(chunk, index, model.tokenizer.pad_token_id))
                for term, value in self.objective.terms.items():
                    totals[term] += value * len(chunk)
            # the dev loss is the cross-entropy (comparable with and without distillation); the KL beside it
            line[f"{name}/loss"] = round(totals.pop("ce") / len(held), 4)
            line.update({f"{name}/{term}": round(value / len(held), 4) for term, value in totals.items()})
            if cfg.eval_generate:
                line.update(self._generation_scores(name, cfg.data[index], held[: cfg.eval_generate], index))
        model.train(was_training)
        self._metric(line)
        log.info("eval at step %d: %s", self.step, {k: v for k, v in line.items() if "/" in k})
        return line

    def _generation_scores(self, name: str, source: Source, examples: list[dict], index: int) -> dict:
        model, pad, objective = self.model, self.model.tokenizer.pad_token_id, OBJECTIVES[source.objective]
        if objective.generate_tokens is None:
            return {}
        outputs, references = [], []
        for start in range(0, len(examples), self.config.batch_size):
            batch: Batch = collate(examples[start : start + self.config.batch_size], index, pad)
            samples = compress_batch(model, batch, source)
            if objective.soft_prompt:  # the output follows the soft prompt: the reference's length and a margin
                prompts = [[] for _ in samples]
                settings = GenerationSettings(max_new_tokens=max(int(batch.token_mask.sum(1).max()) + 8, 8))
            else:
                prompts = [ids[:t].tolist() for ids, t in zip(batch.input_ids, batch.target_starts)]
                settings = GenerationSettings(max_new_tokens=objective.generate_tokens)
            outputs += generate(model, samples, prompts, settings, soft_prompt=objective.soft_prompt,
                                prefixes=batch.prefixes)
            references += batch.references
        return {f"{name}/{metric}": value for metric, value in objective.score(outputs, references).items()}

    # ------------------------------------------------------------------ output
    def _metric(self, line: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with (self.out / METRICS_FILE).open("a") as f:
            f.write(json.dumps(line) + "\n")
        if self.accelerator.trackers and "step" in line:
            self.accelerator.log({k: v for k, v in line.items() if isinstance(v, (int, float))}, step=line["step"])

    def _truncate_metrics(self, step: int) -> None:
        path = self.out / METRICS_FILE
        if self.accelerator.is_main_process and path.is_file():
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            kept = [x for x in lines if x.get("step", 0) <= step and x.get("kind") != "data"]
            write_atomic(path, "".join(json.dumps(x) + "\n" for x in kept))

    def plot(self) -> Path | None:
        """Train loss per source and dev loss against steps, and beside them the dev generation scores (autoencoding
        BLEU, ROUGE, QA accuracy) where the run computes them, as loss.png."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        lines = [json.loads(x) for x in (self.out / METRICS_FILE).read_text().splitlines() if x.strip()]
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        scores: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for line in lines:
            for key, value in line.items():
                if key.startswith("loss/") and line["kind"] == "train":
                    series[f"train {key[5:]}"].append((line["step"], value))
                elif key.endswith("/loss") and line["kind"] == "eval":
                    series[f"dev {key[:-5]}"].append((line["step"], value))
                elif "/" in key and line["kind"] == "eval" and key.rsplit("/", 1)[1] not in LOSS_TERMS:
                    scores[f"dev {key}"].append((line["step"], value))
        if not series:
            return None
        panels = [(series, "loss (nats/token)", "-")] + ([(scores, "dev score", "o-")] if scores else [])
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.6), dpi=100, squeeze=False)
        for ax, (curves, ylabel, style) in zip(axes[0], panels):
            for label, points in sorted(curves.items()):
                steps, values = zip(*points)
                ax.plot(steps, values, "o-" if label.startswith("dev") else style, label=label, markersize=3,
                        linewidth=1)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path = self.out / PLOT_FILE
        fig.savefig(path)
        plt.close(fig)
        return path


class _Window:
    """Losses, tokens (and the share of padding, of packed documents' rows with `packing`) and model FLOPs since the
    last metric line (MFU against `peak` FLOP/s, where known)."""

    def __init__(self, peak: float | None = None, packing: bool = False):
        self.peak, self.packing = peak, packing
        self.losses: dict[str, list[float]] = defaultdict(list)
        self.terms: dict[str, list[float]] = defaultdict(list)
        self.tokens, self.padded, self.seconds = 0, 0, 0.0
        self.flops: float | None = 0.0  # None once a micro-batch was not counted (autoregressive mode)

    def add(self, name: str, loss: float, batch: Batch, terms: dict[str, float], flops: float | None) -> None:
        self.losses[name].append(loss)
        if "kl" in terms:  # the loss mixes CE and KL: log each
            for term, value in terms.items():
                self.terms[f"{term}/{name}"].append(value)
        self.tokens += batch.tokens
        self.padded += batch.packed_tokens if self.packing else batch.padded_tokens
        self.flops = None if flops is None or self.flops is None else self.flops + flops

    def flush(self) -> dict:
        line = {f"loss/{k}": round(sum(v) / len(v), 4) for k, v in self.losses.items()}
        line.update({k: round(sum(v) / len(v), 4) for k, v in self.terms.items()})
        line["tokens_per_s"] = round(self.tokens / self.seconds, 1) if self.seconds else 0.0
        line["padding"] = round(1 - self.tokens / self.padded, 3) if self.padded else 0.0
        if self.flops is not None and self.seconds:
            line["model_tflops_per_s"] = float(f"{self.flops / self.seconds / 1e12:.4g}")
            if self.peak:
                line["mfu"] = float(f"{self.flops / self.seconds / self.peak:.4g}")
        self.__init__(self.peak, self.packing)
        return line


def train(config: TrainConfig, model: NuggetModel | None = None) -> TrainResult:
    """Run (or resume) training as configured; returns where the final export went."""
    return Trainer(config, model).train()


def _check_lora(start: str | Path, trained: NuggetConfig, config: NuggetConfig) -> None:
    """Refuse an init_from checkpoint whose adapters have another shape than the config's."""
    differ = [f"lora.{k}={getattr(trained.lora, k)} (the config: {getattr(config.lora, k)})"
              for k in ("rank", "target_modules") if getattr(trained.lora, k) != getattr(config.lora, k)]
    if differ:
        raise ValueError(f"init_from {start} has adapters of another shape: {', '.join(differ)}; set nugget.lora to "
                         "the checkpoint's, or start without init_from")


def write_ready_sets(config: TrainConfig, folder: Path) -> list[dict]:
    """Build every source's train and dev examples as a run of `config` would, and save them as ready sets in
    `folder` (a streamed source has none: it is tokenised as it goes). Returns each set's record and size."""
    base = load_base_model(config.base_model, device="cpu")
    teacher = None
    if config.distill.weight > 0:
        teacher = base if config.distill.teacher is None else load_base_model(config.distill.teacher, device="cpu")
        teacher = int(teacher.model.config.max_position_embeddings)
    max_positions = int(base.model.config.max_position_embeddings)
    written, cache = [], folder / "cache"
    for source, name in zip(config.data, source_names(config.data)):
        builder = example_builder(config, source, base.tokenizer, max_positions, teacher)
        for split, read in ((source.split, source), (source.dev_split, held_out(source))):
            if split is None or source.streaming:
                continue
            examples, skipped = build_examples(read, split, builder, cache)
            target = folder / ready_name(name, split)
            record = write_ready(target, examples, skipped, builder, split)
            size = sum(f.stat().st_size for f in target.iterdir())
            written.append({"set": target.name, "examples": record["examples"], "bytes": size})
    shutil.rmtree(cache, ignore_errors=True)
    return written


def _init_checkpoint(init_from: str, model: NuggetModel) -> str | Path:
    """`init_from` as a directory; 'default' is the checkpoint shipped for the model's base (if any)."""
    if init_from != DEFAULT_CHECKPOINT:
        return init_from
    shipped = default_checkpoint_for(model.base_name)
    if shipped is None:
        raise ValueError(f"init_from='default' names the checkpoint shipped for SmolLM2-135M-Instruct; the base model "
                         f"{model.base_name!r} has none: pass a checkpoint directory, or leave init_from unset")
    return shipped

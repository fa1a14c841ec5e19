"""torch.compile in training (`TrainConfig.compile`): each layer (`layers`), or the step in fixed shapes, compiled
whole (`step`).

A GPU update of this small model costs the host about as much at batch 16 as at 128: every operation of the step
is a kernel launch that Python issues one by one (BENCHMARKS.md, host operations per micro-batch). Traced whole
into one graph per shape (Scorer, top-k, encoder, composition, decoder and loss; AOTAutograd compiles its backward
as one more), and with the optimiser's update compiled too, a step launches without Python in between.

That needs shapes that do not change from step to step. A micro-batch of an objective with bounded widths
(`Objective.fixed_widths`: autoencoding and continuation, the pretraining stage) is laid out in a `Bucket`:
documents right-padded to the objective's longest, decoder tokens to its longest, and as many nugget slots per
document as the longest keeps at the run's lowest ratio. So there is one graph per objective and batch size,
whatever the ratio drawn. Each document fills exactly its own k = ceil(n / r) slots (`scorer.select_fixed`), at the
positions `compose` gives them (`layout.compose_fixed`); the rest are padding, read at weight 0. The loss and
gradients are the eager step's (`ObjectiveLoss`), up to the order of floating-point sums.
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from ..config import DECODER, ENCODER, nugget_count
from ..model.attention import CaptureNuggets
from ..model.layout import compose_fixed
from ..model.nugget_model import NuggetModel
from ..model.prefix_rows import PrefixRows
from ..model.scorer import select_fixed
from .batches import Batch
from .objectives import OBJECTIVES
from .sources import Lengths, Source

COMPILED_BUCKETS = 64  # graphs allowed for the step's function (objectives x batch sizes)
COMPILED_VARIANTS = 64  # recompilations allowed per compiled layer (compile: layers; adapters x grad modes x shapes)


def compile_layers(model: NuggetModel) -> None:
    """`compile: layers`: torch.compile each decoder layer of the base model, with dynamic shapes. Attention runs
    eager (attention.py), so one compiled layer serves all layers; variants arise per adapter, per grad mode and per
    input shape class."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_VARIANTS)
    for layer in model.layers:
        layer.compile(dynamic=True)


@dataclass(frozen=True)
class Bucket:
    """What fixes one compiled graph of the step: an objective's widths and the batch's size. The ratio does not:
    each document's k = ceil(n / r) arrives as a tensor, within a budget of slots that holds the k of the longest
    document at the lowest ratio trained (at a coarser ratio the rest are padding, read at weight 0)."""

    objective: str
    examples: int
    documents: int  # per example (an example with fewer has empty ones)
    document_tokens: int
    decoder_tokens: int
    budget: int  # nugget slots per document
    soft_prompt: bool


@dataclass
class FixedBatch:
    """A micro-batch laid out in its bucket's shapes, on the model's device."""

    document_ids: torch.Tensor  # [examples * documents, opening + document_tokens]: opening + document, right-padded
    lengths: torch.Tensor  # [examples * documents]: each document's tokens (0: absent)
    counts: torch.Tensor  # [examples * documents]: nuggets each keeps, ceil(n / r) (0: absent)
    input_ids: torch.Tensor  # [examples, decoder_tokens], right-padded
    token_mask: torch.Tensor
    labels: torch.Tensor
    rows: PrefixRows | None  # the prompt prefixes, as rows of the decoder's pass


class CompiledStep:
    """The loss of micro-batches whose objective has fixed widths, through one compiled graph per bucket; and the
    optimiser's update (gradient clipping and AdamW), compiled once per set of parameters with gradients (an
    objective that leaves the decoder frozen has its own), and at most once more for the first update, which creates
    the optimiser's state. `backend` and `mode`: torch.compile's (TrainConfig.compile_backend, compile_mode).
    `graphs` counts the graphs compiled so far, of the loss (its backward comes with each) and of the update;
    `buckets`, the buckets seen."""

    def __init__(self, model: NuggetModel, sources: list[Source], lengths: Lengths, lowest_ratio: float,
                 fused: bool = False, backend: str = "inductor", mode: str = "default"):
        self.model, self.sources, self.lowest_ratio, self.fused = model, sources, lowest_ratio, fused
        eos = 0 if model.tokenizer.eos_token_id is None else 1
        self.widths = [None if s.full_context else OBJECTIVES[s.objective].fixed_widths(s, lengths, eos)
                       for s in sources]
        self.graphs = {"loss": 0, "update": 0}
        self.buckets: set[Bucket] = set()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_BUCKETS)
        options = dict(backend=backend, mode=mode, fullgraph=True, dynamic=False)
        self._loss = torch.compile(fixed_loss, **options)
        self._update = torch.compile(clip_and_step, **options)

    def _counted(self, kind: str, compiled, *args):
        """Call a compiled function, counting the graphs dynamo compiles meanwhile."""
        before = counters["stats"]["unique_graphs"]
        try:
            return compiled(*args)
        finally:
            self.graphs[kind] += counters["stats"]["unique_graphs"] - before

    def fits(self, batch: Batch) -> bool:
        """Whether this micro-batch runs compiled: its objective has fixed widths and it reads every document at the
        batch's ratio."""
        return self.widths[batch.source] is not None and not any(batch.readings)

    def bucket(self, batch: Batch) -> Bucket:
        documents, document_tokens, decoder_tokens = self.widths[batch.source]
        objective = OBJECTIVES[self.sources[batch.source].objective]
        return Bucket(objective.name, len(batch.documents), documents, document_tokens, decoder_tokens,
                      nugget_count(document_tokens, self.lowest_ratio), objective.soft_prompt)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, list[int]]:
        """The micro-batch's loss (as `ObjectiveLoss` computes it eagerly) and each example's nugget count."""
        bucket = self.bucket(batch)
        self.buckets.add(bucket)
        ratio = self.model.config.ratio if batch.ratio is None else batch.ratio
        fixed = lay_out(self.model, batch, bucket, ratio)
        with self.model.lock:  # the compiled graph switches adapters, which are global
            loss = self._counted("loss", self._loss, self.model, fixed, bucket, self.fused)
        return loss, [sum(nugget_count(len(d), ratio) for d in docs) for docs in batch.documents]

    def update(self, optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LRScheduler,
               max_grad_norm: float | None) -> None:
        """Clip the gradients to `max_grad_norm` (None or 0: not at all) and step `optimizer`, compiled, then
        `schedule`. The learning rates must be tensors (`tensor_learning_rates`)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self._counted("update", self._update, optimizer, params, max_grad_norm or 0.0)
        with warnings.catch_warnings():  # the schedule cannot see that the compiled update stepped the optimiser
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
            schedule.step()


def lay_out(model: NuggetModel, batch: Batch, bucket: Bucket, ratio: float) -> FixedBatch:
    """`batch`, compressed at `ratio`, in `bucket`'s shapes; a micro-batch that does not fit them is refused by
    name."""
    opening, pad = model.document_opening, model.tokenizer.pad_token_id
    width = len(opening) + bucket.document_tokens
    ids = torch.full((bucket.examples * bucket.documents, width), pad, dtype=torch.long)
    lengths = torch.zeros(bucket.examples * bucket.documents, dtype=torch.long)
    for e, docs in enumerate(batch.documents):
        if len(docs) > bucket.documents or any(len(d) > bucket.document_tokens for d in docs):
            raise ValueError(f"example {e} has documents of {[len(d) for d in docs]} tokens: more than the compiled "
                             f"step's {bucket.documents} of at most {bucket.document_tokens} (Objective.fixed_widths)")
        for d, doc in enumerate(docs):
            row = e * bucket.documents + d
            ids[row, : width] = torch.tensor(opening + list(doc) + [pad] * (bucket.document_tokens - len(doc)))
            lengths[row] = len(doc)
        for d in range(len(docs), bucket.documents):
            ids[e * bucket.documents + d, : len(opening)] = torch.tensor(opening, dtype=torch.long)
    counts = torch.tensor([nugget_count(int(n), ratio) if n else 0 for n in lengths])
    if counts.max() > bucket.budget:
        raise ValueError(f"r = {ratio} keeps up to {int(counts.max())} nuggets of a document, more than the compiled "
                         f"step's {bucket.budget} slots (set by the run's lowest ratio); include {ratio} in "
                         "TrainConfig.ratios")
    grow = bucket.decoder_tokens - batch.input_ids.shape[1]
    if grow < 0:
        raise ValueError(f"the micro-batch's {batch.input_ids.shape[1]} decoder tokens exceed the compiled step's "
                         f"{bucket.decoder_tokens} (Objective.fixed_widths)")
    slots = len(opening) + bucket.documents * bucket.budget
    model.check_positions(slots, bucket.decoder_tokens + (model.soft_prompt.shape[0] if bucket.soft_prompt else 0))
    device = model.device
    return FixedBatch(
        document_ids=ids.to(device), lengths=lengths.to(device), counts=counts.to(device),
        input_ids=F.pad(batch.input_ids, (0, grow), value=pad).to(device),
        token_mask=F.pad(batch.token_mask.bool(), (0, grow)).to(device),
        labels=F.pad(batch.labels, (0, grow), value=-100).to(device),
        rows=PrefixRows.of(batch.prefixes, pad, device),
    )


def fixed_loss(model: NuggetModel, batch: FixedBatch, bucket: Bucket, fused: bool) -> torch.Tensor:
    """The micro-batch's cross-entropy, every operation on the device in fixed shapes (what torch.compile traces)."""
    opening = len(model.document_opening)
    scores = model.score(batch.document_ids, holding_lock=True)[:, opening:]
    positions, chosen = select_fixed(scores, batch.lengths, batch.counts, bucket.budget)
    steps = torch.arange(batch.document_ids.shape[1], device=scores.device)[None]
    capture = CaptureNuggets(positions + opening, inline=True)
    embedding = model.llama.get_input_embeddings()
    model.run_layers(ENCODER, embedding(batch.document_ids), steps, capture)
    keys, values = capture.stacked()
    head = 0 if batch.rows is None else batch.rows.ids.shape[1]
    layout = compose_fixed(keys, values, scores.gather(1, positions), chosen, positions, batch.lengths,
                           bucket.examples, opening, head, model.inv_freq, model.config.nugget_positions, batch.rows)
    embeds, mask = model.embed(batch.input_ids, batch.token_mask, bucket.soft_prompt)
    width = embeds.shape[1]
    embeds, mask, steps = layout.inputs(embeds, mask, embedding)
    reader = layout.reader(mask, embeds.shape[1], fused, right_padded=True)
    reader.inline = True
    hidden = model.run_layers(DECODER, embeds, steps, reader)[: bucket.examples, :width]
    # hidden at position i predicts the token at i + 1; with a soft prompt its last vector predicts token 0
    extra = width - batch.input_ids.shape[1]
    predictors, targets = (hidden[:, extra - 1 : -1], batch.labels) if extra else (hidden[:, :-1], batch.labels[:, 1:])
    logits = model.logits(predictors).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


@torch.no_grad()
def clip_and_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_grad_norm: float) -> None:
    """Gradient clipping and the optimiser's update, in one graph without autograd (what torch.compile traces)."""
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
    # The class's undecorated step: the schedule wraps the instance's in a counter dynamo does not trace, and the
    # class's decorator breaks the graph on purpose, to make its body a graph without autograd (this one is).
    inspect.unwrap(type(optimizer).step)(optimizer)


def tensor_learning_rates(optimizer: torch.optim.Optimizer) -> None:
    """Make each parameter group's learning rate a tensor, which the schedule then fills in place: a float that
    changes every step would recompile the compiled update every step."""
    for group in optimizer.param_groups:
        group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).clone()

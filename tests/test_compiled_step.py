"""The training step in fixed shapes, compiled whole (compiled_step.py): the eager step's loss and gradients, one
graph without a break per bucket, and the optimiser's update compiled beside it. torch.compile runs with the
"aot_eager" backend here (dynamo's tracing and AOTAutograd's joint graph, without inductor's code generation, which
takes minutes on a CPU): a graph break or a recompilation shows there as it would under inductor."""

import warnings

import pytest
import torch
from test_train import NUGGET, config, gradients, source, tiny_model
from tiny import tiny_base

from nugget_rag.config import NuggetConfig, nugget_count
from nugget_rag.model import NuggetModel, attention
from nugget_rag.model.scorer import select_fixed, select_nuggets
from nugget_rag.train import compiled_step
from nugget_rag.train.compiled_step import CompiledStep
from nugget_rag.train.trainer import Trainer


@pytest.mark.parametrize("lengths", [[5, 17, 1, 12], [30, 30, 2, 9]])
@pytest.mark.parametrize("ratio", [1.0, 2.0, 3.5, 10.0])
def test_fixed_selection_keeps_what_select_nuggets_keeps(lengths, ratio):
    scores = torch.randn(len(lengths), 30, generator=torch.Generator().manual_seed(len(lengths) + int(ratio)))
    budget = nugget_count(30, ratio)
    counts = torch.tensor([nugget_count(n, ratio) for n in lengths])
    positions, chosen = select_fixed(scores, torch.tensor(lengths), counts, budget)
    assert positions.shape == chosen.shape == (len(lengths), budget)
    for row, (n, expected) in enumerate(zip(lengths, select_nuggets(scores, lengths, ratio))):
        assert int(chosen[row].sum()) == len(expected)
        assert positions[row, : len(expected)].tolist() == expected.tolist()
        assert (positions[row, len(expected) :] == n - 1).all()  # padding slots point at a real token


@pytest.mark.parametrize(("name", "nugget_positions", "attention"), [
    ("autoencoding", "renumbered", "reference"), ("autoencoding", "original", "fused"),
    ("continuation", "renumbered", "fused"), ("continuation", "original", "reference")])
def test_compiled_step_equals_eager_step(name, nugget_positions, attention, data, tmp_path):
    """The same loss and gradients as ObjectiveLoss's eager step, through one graph with no graph break (fullgraph:
    a break raises), at two ratios: one graph for both.
    Both decoder readers: under a float mask (reference) and with the bias in a channel (fused, CUDA's default)."""
    sources = [source(name, data) | ({"documents_per_example": 2} if name == "continuation" else {})]
    nugget = {**NUGGET, "nugget_positions": nugget_positions}
    cfg = config(tmp_path, sources, batch_size=3, nugget=nugget)
    run = Trainer(cfg.model_copy(update={"attention": attention}), NuggetModel(tiny_base(), NuggetConfig(**nugget)))
    run.model.train()
    step = CompiledStep(run.model, cfg.data, cfg.lengths, 2.0, fused=attention == "fused", backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    for ratio in (2.0, 4.0, 4.0):
        batch = run.mixture.next_batch()
        batch.ratio = ratio
        eager = run.objective(batch)
        eager.backward()
        expected = gradients(run.model)
        run.optimizer.zero_grad(set_to_none=True)
        compiled, nuggets = step.loss(batch)
        compiled.backward()
        got = gradients(run.model)
        run.optimizer.zero_grad(set_to_none=True)
        assert float(compiled.detach()) == pytest.approx(float(eager.detach()), rel=1e-5)
        assert expected and got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-3, atol=1e-6)
        assert nuggets == [sum(nugget_count(len(d), ratio) for d in docs) for docs in batch.documents]
    assert step.graphs["loss"] == 1 and len(step.buckets) == 1
    assert not torch._dynamo.utils.counters["graph_break"]


def test_the_compiled_update_equals_the_eager_update(data, tmp_path):
    """Gradient clipping and AdamW in one compiled graph, learning rates as tensors that the schedule fills: the same
    weights after three updates as the eager optimiser's; compiled once (twice at most: the first update creates the
    optimiser's state), with no warning that the schedule stepped first."""
    weights = []
    for arm in ("eager", "compiled"):
        cfg = config(tmp_path / arm, [source("autoencoding", data)], batch_size=2, compile="off",
                     optim={"warmup_steps": 2, "lr": 1e-2, "max_grad_norm": 0.05})
        run = Trainer(cfg, tiny_model())
        step = CompiledStep(run.model, cfg.data, cfg.lengths, 4.0, backend="aot_eager") if arm == "compiled" else None
        if step is not None:
            compiled_step.tensor_learning_rates(run.optimizer)
        run.model.train()
        for _ in range(3):
            run.objective(run.mixture.next_batch()).backward()
            if step is None:
                torch.nn.utils.clip_grad_norm_(run.model.parameters(), 0.05)
                run.optimizer.step()
                run.scheduler.step()
            else:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    step.update(run.optimizer.optimizer, run.scheduler, 0.05)
                assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
            run.optimizer.zero_grad(set_to_none=True)
        weights.append({k: p.detach().clone() for k, p in run.model.named_parameters() if p.requires_grad})
    assert 1 <= step.graphs["update"] <= 2
    for key in weights[0]:
        torch.testing.assert_close(weights[1][key], weights[0][key], rtol=1e-4, atol=1e-6)


def test_a_compiled_run_compiles_once_per_bucket(data, tmp_path):
    """`compile: step` over autoencoding and continuation at r in {2, 4}: 12 updates, one loss graph per objective
    and at most two of the update, reported in the run's metric lines; the dev evaluation runs eager."""
    sources = [source("autoencoding", data), source("continuation", data)]
    run = Trainer(config(tmp_path, sources, batch_size=2, compile="step", compile_backend="aot_eager",
                         ratios={"choices": [2, 4]}, max_steps=12,
                         log_every=12, save_every=12, eval_every=12), tiny_model())
    result = run.train()
    line = result.losses[-1]
    assert result.step == 12 and line["buckets"] == 2
    assert line["loss_graphs"] == line["buckets"] and 1 <= line["update_graphs"] <= 2


def test_compile_true_still_means_per_layer(data, tmp_path):
    sources = [source("autoencoding", data)]
    assert config(tmp_path, sources, compile=True).compile == "layers"
    assert config(tmp_path, sources, compile=False).compile == "off"


def test_a_ratio_below_the_runs_lowest_is_refused_by_name(data, tmp_path):
    cfg = config(tmp_path, [source("autoencoding", data)], batch_size=2)
    run = Trainer(cfg, tiny_model())
    step = CompiledStep(run.model, cfg.data, cfg.lengths, 4.0, backend="aot_eager")
    batch = run.mixture.next_batch()
    batch.ratio = 2.0
    with pytest.raises(ValueError, match=r"r = 2.0 keeps up to \d+ nuggets .* include 2.0 in TrainConfig.ratios"):
        step.loss(batch)


def test_the_fused_readers_cuda_branch_traces_too(data, tmp_path, monkeypatch):
    """On CUDA the eager fused reader gives SDPA causality as a `CausalBias` flag, which dynamo does not trace; the
    compiled step gives it as a boolean mask (CUDA's branch forced here on the CPU): the same loss and gradients."""
    monkeypatch.setattr(attention, "takes_causal_flag", lambda device: True)
    cfg = config(tmp_path, [source("autoencoding", data)], batch_size=3, attention="fused")
    run = Trainer(cfg, tiny_model())
    run.model.train()
    batch = run.mixture.next_batch()
    run.objective(batch).backward()
    expected = gradients(run.model)
    run.optimizer.zero_grad(set_to_none=True)
    step = CompiledStep(run.model, cfg.data, cfg.lengths, 4.0, fused=True, backend="aot_eager")
    step.loss(batch)[0].backward()
    got = gradients(run.model)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-3, atol=1e-6)


def test_the_compiled_step_refuses_gradient_checkpointing_by_name(data, tmp_path):
    with pytest.raises(ValueError, match="compile: step with gradient_checkpointing"):
        config(tmp_path, [source("autoencoding", data)], compile="step", gradient_checkpointing=True)

"""A run's metrics: the lines of metrics.jsonl (and the trackers beside it), the window a train line averages, the
loss plot."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from accelerate import Accelerator

from ..state.files import write_atomic
from .batches import Batch

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
LOSS_TERMS = {"loss", "ce", "kl"}  # what an eval line reports beside the generation scores


class MetricsFile:
    """metrics.jsonl in a run's folder, written by the main process; a line with a step also goes to the trackers."""

    def __init__(self, out: Path, accelerator: Accelerator):
        self.out, self.accelerator = out, accelerator

    def write(self, line: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with (self.out / METRICS_FILE).open("a") as f:
            f.write(json.dumps(line) + "\n")
        if self.accelerator.trackers and "step" in line:
            self.accelerator.log({k: v for k, v in line.items() if isinstance(v, (int, float))}, step=line["step"])

    def truncate(self, step: int) -> None:
        """Drop the lines after `step` (a resumed run writes them again) and the data lines (written again too)."""
        path = self.out / METRICS_FILE
        if self.accelerator.is_main_process and path.is_file():
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            kept = [x for x in lines if x.get("step", 0) <= step and x.get("kind") != "data"]
            write_atomic(path, "".join(json.dumps(x) + "\n" for x in kept))


class Window:
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


def plot(out: Path) -> Path | None:
    """Train loss per source and dev loss against steps, and beside them the dev generation scores (autoencoding
    BLEU, ROUGE, QA accuracy) where the run computes them, as loss.png in `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [json.loads(x) for x in (out / METRICS_FILE).read_text().splitlines() if x.strip()]
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
    path = out / PLOT_FILE
    fig.savefig(path)
    plt.close(fig)
    return path

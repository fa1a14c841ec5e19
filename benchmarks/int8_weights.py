"""How far int8 weights move the model: next-token KL to float32 and top-1 agreement, teacher-forced over dev
SQuAD paragraphs, for this project's weight-only int8 (nugget_rag/model/int8.py), torch's dynamic int8 quantisation
(weights and inputs) and bfloat16 weights. The base model alone: the adapters add nothing to the question.

    python benchmarks/int8_weights.py --paragraphs 12 --threads 2

Writes benchmarks/results/int8-weights.{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import RESULTS, made_by, run_meta, table, write_report  # noqa: E402

from nugget_rag.corpora import read_squad  # noqa: E402
from nugget_rag.model.base_model import load_base_model  # noqa: E402
from nugget_rag.model.int8 import Int8Linear  # noqa: E402


def int8_rows(model: nn.Module) -> nn.Module:
    """Every linear layer as Int8Linear, its int8 kernel forced (teacher forcing runs many rows at once)."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                layer = Int8Linear(child.weight, child.bias)
                parent._modules[name] = RowByRow(layer)
    return model


class RowByRow(nn.Module):
    """Feeds an Int8Linear one row at a time, as decoding does."""

    def __init__(self, layer: Int8Linear):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return torch.cat([self.layer(r[None]) for r in rows]).reshape(*x.shape[:-1], -1)


def dynamic_int8(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)


VARIANTS = {
    "int8 weights (nugget-rag)": int8_rows,
    "int8 weights and inputs (torch quantize_dynamic)": dynamic_int8,
    "bfloat16 weights": lambda m: copy.deepcopy(m).to(torch.bfloat16),
}


@torch.inference_mode()
def measure(model: nn.Module, paragraphs: list[list[int]]) -> dict:
    reference = [F.log_softmax(model(input_ids=torch.tensor([ids])).logits.float(), -1) for ids in paragraphs]
    rows = {}
    for label, make in VARIANTS.items():
        variant = make(model)
        kl, agree, tokens = 0.0, 0.0, 0
        for ids, ref in zip(paragraphs, reference):
            out = F.log_softmax(variant(input_ids=torch.tensor([ids])).logits.float(), -1)
            kl += float(F.kl_div(out, ref, log_target=True, reduction="none").sum(-1).sum())
            agree += float((out.argmax(-1) == ref.argmax(-1)).sum())
            tokens += len(ids)
        rows[label] = {"kl": kl / tokens, "top1_agreement": agree / tokens}
    return {"tokens": sum(map(len, paragraphs)), "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/squad-dev-v1.1.json"))
    parser.add_argument("--paragraphs", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_base_model(None, device="cpu", dtype=torch.float32)
    contexts = list(dict.fromkeys(r["context"] for r in read_squad(args.data, split="dev")))[: args.paragraphs]
    paragraphs = [base.tokenizer(c)["input_ids"][: args.max_tokens] for c in contexts]
    result = measure(base.model, paragraphs)
    command = shlex.join(["python", "benchmarks/int8_weights.py", *(sys.argv[1:] if argv is None else argv)])
    result = {"meta": run_meta(command=command), **result}
    lines = [f"# int8 weights: next-token distributions against float32 ({base.name})", "",
             *made_by(result["meta"], f"torch {torch.__version__}; {len(paragraphs)} dev SQuAD paragraphs, "
                      f"{result['tokens']} tokens, teacher-forced"), "",
             *table(["weights", "KL to float32 (nats/token)", "top-1 agreement"],
                    ([label, f"{row['kl']:.4f}", f"{row['top1_agreement']:.3f}"]
                     for label, row in result["rows"].items()))]
    write_report(args.out_dir / "int8-weights", result, "\n".join(lines) + "\n")

if __name__ == "__main__":
    main()

"""Does a selection keep the answer? For SQuAD questions, the share of gold answer tokens among the k = ceil(n / r)
positions each query-agnostic selection keeps: the first k (truncation), k at random, the two training-free signals
the Scorer warm start can fit (KVzip's reconstruction attention, observed attention) and each checkpoint's Scorer.
A question counts as "any" when some token of a gold answer (any of its occurrences in the passage) is kept,
"whole" when every token of one is. It separates what a compressor fails to keep from what its decoder fails to
read from what it kept.

    python benchmarks/answer_coverage.py --questions 200 --ratios 5 10 --checkpoints default none --threads 2

The questions are those of `nugget-rag eval --tasks squad --sample random --sample-seed SEED --limit N` (the same
seeded shuffle of the split). Writes benchmarks/results/answer-coverage.{md,json}.
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import RESULTS, made_by, run_meta, table, write_report  # noqa: E402

from nugget_rag import NuggetModel  # noqa: E402
from nugget_rag.corpora import read_squad  # noqa: E402
from nugget_rag.eval.tasks import seeded_sample  # noqa: E402
from nugget_rag.model.scorer import select_nuggets  # noqa: E402
from nugget_rag.train.warm_start import answer_spans, importance_targets  # noqa: E402


def scorer_selection(model: NuggetModel, ids: list[int], ratio: float) -> set[int]:
    input_ids, opening = model.encoder_input([ids])
    scores = model.score(input_ids)[:, opening:]
    return set(select_nuggets(scores, [len(ids)], ratio)[0].tolist())


def signal_selection(model: NuggetModel, ids: list[int], ratio: float, signal: str) -> set[int]:
    """Top k of a warm-start signal of the frozen model (the last position always kept)."""
    with torch.no_grad():
        target, = importance_targets(model, [ids], signal)
    return set(select_nuggets(torch.cat([target, target.new_zeros(1)])[None], [len(ids)], ratio)[0].tolist())


def coverage(shares: list[float]) -> dict[str, float]:
    n = len(shares)
    return {"any": 100 * sum(s > 0 for s in shares) / n, "whole": 100 * sum(s == 1 for s in shares) / n,
            "mean_share": 100 * sum(shares) / n, "questions": n}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/squad-dev-v1.1.json"))
    parser.add_argument("--split", default="dev")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="the eval's --sample-seed")
    parser.add_argument("--ratios", type=float, nargs="+", default=[5.0, 10.0])
    parser.add_argument("--checkpoints", nargs="+", default=["default"],
                        help="checkpoint directories whose Scorers to compare; 'default' (shipped), 'none' (untrained)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    records = seeded_sample(read_squad(args.data, split=args.split), args.seed)[: args.questions]

    models = {c: NuggetModel.from_pretrained(None if c == "none" else c, dtype="float32") for c in args.checkpoints}
    frozen = next(iter(models.values()))
    tokenizer = frozen.tokenizer
    rng = random.Random(args.seed)
    shares: dict[str, dict[float, list[float]]] = {}
    for rec in records:
        enc = tokenizer(rec["context"], add_special_tokens=False, return_offsets_mapping=True)
        ids, n = enc["input_ids"], len(enc["input_ids"])
        spans = answer_spans(rec["context"], rec["answers"], enc["offset_mapping"])
        if not spans:
            continue
        for ratio in args.ratios:
            k = math.ceil(n / ratio)
            kept = {"truncation (first k)": set(range(k)),
                    "random k (last kept)": set(rng.sample(range(n - 1), k - 1)) | {n - 1},
                    "KVzip reconstruction attention": signal_selection(frozen, ids, ratio, "kvzip"),
                    "observed attention": signal_selection(frozen, ids, ratio, "observed_attention")}
            kept |= {f"Scorer of {c}": scorer_selection(m, ids, ratio) for c, m in models.items()}
            for name, chosen in kept.items():
                share = max(len(span & chosen) / len(span) for span in spans)
                shares.setdefault(name, {}).setdefault(ratio, []).append(share)

    rows = {name: {str(r): coverage(v) for r, v in by_ratio.items()} for name, by_ratio in shares.items()}
    command = shlex.join(["python", "benchmarks/answer_coverage.py", *(sys.argv[1:] if argv is None else argv)])
    meta = run_meta(command=command)
    questions = len(next(iter(next(iter(shares.values())).values())))
    lines = ["# Does a selection keep the answer? (SQuAD, query-agnostic selections)", "",
             *made_by(meta, f"torch {torch.__version__}; {questions} {args.split} questions (seeded sample, seed "
                      f"{args.seed})"), "",
             "Share of questions with some / a whole gold answer among the kept positions, and the mean share of an "
             "answer's tokens kept (best occurrence).", "",
             *table(["selection", *(f"r = {r:g}: any / whole / mean" for r in args.ratios)],
                    ([name, *(f"{c['any']:.1f} / {c['whole']:.1f} / {c['mean_share']:.1f}" for c in by_ratio.values())]
                     for name, by_ratio in rows.items()))]
    write_report(args.out_dir / "answer-coverage", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")

if __name__ == "__main__":
    main()

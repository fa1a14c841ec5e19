"""Two checkpoints' autoencoding on the same passages, side by side: corpus BLEU of each and the paired difference
of sentence BLEU (mean ± standard error), per ratio, from two `nugget-rag eval` predictions files.

    nugget-rag eval --tasks autoencoding --data autoencoding=../corpus/dev.jsonl --systems nugget --ratios 1 2 10 \
        --split dev --limit 30 --sample random --task-limit autoencoding=30 --ae-lengths 100 --name before [--checkpoint ...]
    (the same with --name after --checkpoint CANDIDATE)
    python benchmarks/paired_bleu.py runs/before-predictions.jsonl runs/after-predictions.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sacrebleu

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_out_option, run_meta, table, write_report  # noqa: E402

from nugget_rag.eval.metrics import paired_difference  # noqa: E402


def load(path: Path) -> dict[tuple[float, str], dict]:
    """(ratio, example id) -> the autoencoding prediction."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["ratio"], r["id"]): r for r in rows if r["task"] == "autoencoding"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    add_out_option(parser)
    args = parser.parse_args()
    before, after = load(args.before), load(args.after)
    shared = sorted(set(before) & set(after))
    if not shared:
        raise SystemExit(f"{args.before.name} and {args.after.name} share no (ratio, passage): score the same passages")
    rows = []
    for ratio in sorted({r for r, _ in shared}):
        keys = [k for k in shared if k[0] == ratio]
        refs = [before[k]["references"][0] for k in keys]
        corpus = [sacrebleu.corpus_bleu([p[k]["output"] for k in keys], [refs]).score for p in (before, after)]
        mean, se = paired_difference(*([sacrebleu.sentence_bleu(p[k]["output"], [ref]).score for k, ref in zip(keys, refs)]
                                       for p in (before, after)))
        rows.append({"ratio": ratio, "passages": len(keys), "before": corpus[0], "after": corpus[1], "paired": mean,
                     "paired_se": se})
    text = "\n".join(table(["r", "passages", args.before.stem, args.after.stem, "paired (sentence BLEU)"],
                           ([f"{r['ratio']:g}", r["passages"], f"{r['before']:.1f}", f"{r['after']:.1f}",
                             f"{r['paired']:+.1f} ± {r['paired_se']:.1f}"] for r in rows))) + "\n"
    write_report(args.out, {"meta": run_meta(), "rows": rows}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

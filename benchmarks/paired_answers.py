"""QA systems side by side on the same questions, from the harness's prediction files: each one's accuracy, its
paired difference from the first, where its answers stop (the share that reach the token limit, and the share
cut mid-sentence there), and the share that repeat themselves (an n-gram of the decoder's tokens twice).

    python benchmarks/paired_answers.py RUN-predictions.jsonl[:SYSTEM] ... [--limit 64] [--ngram 8] [--out OUT]
        [--repeating-ids FILE]

--repeating-ids writes the ids of the first system's answers that repeat an n-gram: the only answers that greedy
decoding under `no_repeat_ngram_size=n` changes, to rerun with `nugget-rag eval --only-ids FILE`.

Each argument names a predictions file (`nugget-rag eval` writes NAME-predictions.jsonl) and, after a colon, one
of its systems (default: every system in it, in order). Only the questions every system answered are compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_out_option, run_meta, write_report  # noqa: E402

from nugget_rag.eval.metrics import answer_correct, paired_difference  # noqa: E402
from nugget_rag.generation.text import ends_sentence, first_repeat  # noqa: E402
from nugget_rag.model.base_model import load_base_model  # noqa: E402


def load(spec: str) -> dict[str, dict[str, dict]]:
    """'PATH[:SYSTEM]' -> label -> question id -> prediction."""
    path, _, wanted = spec.partition(":")
    found: dict[str, dict[str, dict]] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if not wanted or record["system"] == wanted:
            found.setdefault(f"{record['system']} ({Path(path).stem.removesuffix('-predictions')})", {})[
                record["id"]] = record
    if not found:
        raise SystemExit(f"{path} holds no predictions" + (f" of system {wanted!r}" if wanted else ""))
    return found


def compare(systems: dict[str, dict[str, dict]], encode, limit: int, ngram: int = 8) -> list[dict]:
    """One row a system: correct (%), paired vs the first (mean, se), reached the limit (%), cut mid-sentence (%),
    repeat an `ngram`-gram (%); `encode` gives an answer's tokens."""
    ids = sorted(set.intersection(*(set(p) for p in systems.values())))
    if not ids:
        raise SystemExit("the systems share no question: compare runs over the same questions")
    first = None
    rows = []
    for label, predictions in systems.items():
        right = [float(answer_correct(predictions[q]["output"], predictions[q]["references"])) for q in ids]
        first = first or right
        mean, se = paired_difference(first, right)
        encoded = [encode(predictions[q]["output"]) for q in ids]
        lengths = [len(e) for e in encoded]
        repeats = [first_repeat(e, ngram) is not None for e in encoded]
        reached = [n >= limit - 1 for n in lengths]  # decoding and re-encoding may merge a token
        cut = [r and not ends_sentence(predictions[q]["output"]) for r, q in zip(reached, ids)]
        rows.append({"system": label, "questions": len(ids), "correct": 100 * sum(right) / len(ids),
                     "paired": 100 * mean, "paired_se": 100 * se, "reached_limit": 100 * sum(reached) / len(ids),
                     "cut_mid_sentence": 100 * sum(cut) / len(ids), "mean_tokens": sum(lengths) / len(ids),
                     "repeat_ngram": 100 * sum(repeats) / len(ids)})
    return rows


def repeating(predictions: dict[str, dict], encode, ngram: int) -> list[str]:
    """The ids of the answers whose tokens repeat an `ngram`-gram."""
    return [q for q, p in predictions.items() if first_repeat(encode(p["output"]), ngram) is not None]


def table(rows: list[dict], limit: int, ngram: int = 8) -> str:
    lines = [f"| system | correct | paired vs the first | reach {limit} tokens | cut mid-sentence | mean tokens | "
             f"repeat a {ngram}-gram |", "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(rows):
        paired = "" if i == 0 else f"{row['paired']:+.1f} ± {row['paired_se']:.1f}"
        lines.append(f"| {row['system']} | {row['correct']:.1f} | {paired} | {row['reached_limit']:.0f}% | "
                     f"{row['cut_mid_sentence']:.0f}% | {row['mean_tokens']:.0f} | {row['repeat_ngram']:.0f}% |")
    return "\n".join(lines) + f"\n\n{rows[0]['questions']} questions answered by every system.\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="PREDICTIONS[:SYSTEM]")
    parser.add_argument("--limit", type=int, default=64, help="the runs' max_new_tokens (default 64, the harness's)")
    parser.add_argument("--ngram", type=int, default=8, help="count the answers that repeat an n-gram of this many "
                        "tokens (default 8)")
    add_out_option(parser)
    parser.add_argument("--repeating-ids", type=Path, metavar="FILE", help="write the ids of the first system's "
                        "answers that repeat an --ngram n-gram, one a line")
    args = parser.parse_args()
    systems: dict[str, dict[str, dict]] = {}
    for spec in args.runs:
        systems |= load(spec)
    tokenizer = load_base_model().tokenizer
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = compare(systems, encode, args.limit, args.ngram)
    write_report(args.out, {"meta": run_meta(), "runs": args.runs, "limit": args.limit, "ngram": args.ngram,
                            "rows": rows}, table(rows, args.limit, args.ngram))
    if args.repeating_ids:
        ids = repeating(next(iter(systems.values())), encode, args.ngram)
        args.repeating_ids.write_text("".join(f"{q}\n" for q in ids))
        print(f"{args.repeating_ids}: {len(ids)} answers repeat a {args.ngram}-gram")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

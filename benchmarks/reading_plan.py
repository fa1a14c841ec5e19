"""Choose the reading plan's two free settings from one dev run of the harness: how many passages to read whole
(by the question-likelihood probe's margin) and where an answer stops (stop strings).

    nugget-rag eval --tasks squad_rag --systems likelihood_select likelihood_select_top2 --ratios 10 \
        --split dev --limit 200 --sample random --threads 1 --out-dir runs/plan --name squad-rag-dev
    python benchmarks/reading_plan.py runs/plan/squad-rag-dev-predictions.jsonl [--out benchmarks/results/reading-plan]

Greedy decoding makes both choices exact offline: the answer generated with a stop string is the 64-token answer
cut at its first occurrence, and a rule that reads two passages for some questions gives, for each question, the
answer of `likelihood_select` or of `likelihood_select_top2`. Dev data only: the test split is for the final
measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_out_option, run_meta, write_report  # noqa: E402

from nugget_rag.eval.metrics import answer_correct, paired_difference  # noqa: E402
from nugget_rag.model.base_model import load_base_model  # noqa: E402

ONE, TWO = "likelihood_select", "likelihood_select_top2"
STOPS = {"none": [], "blank line": ["\n\n"], "new line": ["\n"]}
MAX_NEW_TOKENS = 64


def cut(text: str, stops: list[str]) -> str:
    """The answer generation with these stop strings would have given."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text


def load(path: Path) -> dict[str, dict[str, dict]]:
    """system -> question id -> prediction."""
    found: dict[str, dict[str, dict]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        found.setdefault(record["system"], {})[record["id"]] = record
    missing = {ONE, TWO} - set(found)
    if missing:
        raise SystemExit(f"{path} has no predictions of {sorted(missing)}; run the eval command in this file's docstring")
    return found


def margin(record: dict) -> float:
    """The probe's margin: the top passage's mean log-likelihood of the question minus the second's."""
    ranked = sorted(record["info"]["relevance"], reverse=True)
    return ranked[0] - ranked[1] if len(ranked) > 1 else math.inf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("predictions", type=Path)
    add_out_option(parser)
    args = parser.parse_args()
    found = load(args.predictions)
    ids = sorted(set(found[ONE]) & set(found[TWO]))
    tokenizer = load_base_model().tokenizer
    lines = [f"# Reading plan, chosen on dev ({len(ids)} questions of `{args.predictions.name}`)", ""]
    result: dict = {"questions": len(ids), "stops": {}, "margins": {}}

    lines += ["## Where an answer stops", "", "| stop | system | correct | cut at the limit | paired vs none |",
              "|---|---|---|---|---|"]
    for system in (ONE, TWO):
        base = [float(answer_correct(found[system][q]["output"], found[system][q]["references"])) for q in ids]
        for name, stops in STOPS.items():
            outputs = [cut(found[system][q]["output"], stops) for q in ids]
            right = [float(answer_correct(o, found[system][q]["references"])) for o, q in zip(outputs, ids)]
            limit = [float(o == found[system][q]["output"] and len(tokenizer(o, add_special_tokens=False)["input_ids"])
                           >= MAX_NEW_TOKENS - 1) for o, q in zip(outputs, ids)]
            mean, se = paired_difference(base, right)
            row = {"correct": 100 * sum(right) / len(ids), "cut_at_limit": 100 * sum(limit) / len(ids),
                   "paired": 100 * mean, "paired_se": 100 * se}
            result["stops"][f"{system}/{name}"] = row
            lines.append(f"| {name} | {system} | {row['correct']:.1f} | {row['cut_at_limit']:.0f}% | "
                         f"{row['paired']:+.1f} ± {row['paired_se']:.1f} |")

    lines += ["", "## How many passages to read whole: two when the probe's margin is at most m", "",
              "| m | read two | correct | paired vs one |", "|---|---|---|---|"]
    one = {q: float(answer_correct(found[ONE][q]["output"], found[ONE][q]["references"])) for q in ids}
    two = {q: float(answer_correct(found[TWO][q]["output"], found[TWO][q]["references"])) for q in ids}
    margins = {q: margin(found[ONE][q]) for q in ids}
    for m in sorted({0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, math.inf}):
        picked = [two[q] if margins[q] <= m else one[q] for q in ids]
        mean, se = paired_difference([one[q] for q in ids], picked)
        row = {"read_two": 100 * sum(margins[q] <= m for q in ids) / len(ids), "correct": 100 * sum(picked) / len(ids),
               "paired": 100 * mean, "paired_se": 100 * se}
        result["margins"][str(m)] = row
        lines.append(f"| {m:g} | {row['read_two']:.0f}% | {row['correct']:.1f} | "
                     f"{row['paired']:+.1f} ± {row['paired_se']:.1f} |")
    write_report(args.out, {"meta": run_meta(), **result}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

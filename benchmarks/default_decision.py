"""Whether a candidate replaces the shipped default, by the rule fixed before any candidate was scored
(MODEL_CARD.md "Choosing the next default"): it wins at r = 10 beyond noise, and loses nothing beyond noise elsewhere.

    bash scripts/score_candidate.sh default runs/score/stage5
    bash scripts/score_candidate.sh CANDIDATE runs/score/candidate
    python benchmarks/default_decision.py runs/score/stage5 runs/score/candidate [--out benchmarks/results/NAME]

Each folder holds harness runs (NAME.json beside NAME-predictions.jsonl); runs of the same name are paired. Every
measure is a (task, system, ratio, data file) of the runs, each item scored per item (QA: answer correct, 0 or 100; autoencoding:
sentence BLEU; long-document summaries: ROUGE-L F1), pooled over runs of the same measure (a question drawn by two seeds counts once) and compared on the
items both folders scored: the paired difference candidate - baseline, mean ± standard error. Beyond noise is two
standard errors. A run on a test part is refused: choosing a default is tuning, and tuning reads dev parts only.

The decision records the sha256 of the weights each folder scored (the harness's `setup.weights_sha256`, its first 16
hex digits), which scripts/ship_default.py checks; a folder whose runs scored different weights is refused, never
pooled.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import sacrebleu

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_out_option, run_meta, write_report  # noqa: E402

from nugget_rag.eval.metrics import answer_correct, paired_difference, rouge  # noqa: E402

PRIMARY = ("squad", 10.0)  # the measure the candidate must win
NOISE = 2.0  # standard errors


class Measure(NamedTuple):
    task: str
    system: str
    ratio: float | None  # None: a reading plan, which reads each passage at a ratio of its own (or as text)
    source: str

    def __str__(self) -> str:
        ratio = "as planned" if self.ratio is None else f"r = {self.ratio:g}"
        return f"{self.task} {ratio} ({self.system}, {self.source})"


class Folder(NamedTuple):
    """One checkpoint's runs: measure -> item id -> prediction, and the digest of the weights they scored."""

    measures: dict[Measure, dict[str, dict]]
    weights_sha256: str


def item_score(record: dict) -> float:
    """One prediction's score: autoencoding's sentence BLEU, a long document's summary's ROUGE-L (0..100), else
    whether the answer is right (0 or 100)."""
    if record["task"] == "autoencoding":
        return sacrebleu.sentence_bleu(record["output"], [record["references"][0]]).score
    if record["task"] == "long_documents":
        return rouge([record["output"]], [record["references"][0]])["rougeL"]
    return 100.0 * answer_correct(record["output"], record["references"])


def corpus_score(records: list[dict]) -> float:
    """The measure's usual score over these items: corpus BLEU for autoencoding, else the mean item score (the share
    answered right; summaries' mean ROUGE-L)."""
    if records[0]["task"] == "autoencoding":
        return sacrebleu.corpus_bleu([r["output"] for r in records], [[r["references"][0] for r in records]]).score
    return sum(item_score(r) for r in records) / len(records)


def run_weights(summary: Path, tasks: dict) -> str:
    """The digest of the nugget weights the run `summary` scored (its tasks' setup.weights_sha256[0])."""
    digests = {((task.get("setup") or {}).get("weights_sha256") or [None])[0] for task in tasks.values()} or {None}
    if len(digests) != 1 or None in digests:
        raise SystemExit(f"{summary} records {'no digest' if None in digests else 'several digests'} of the nugget "
                         "weights it scored (setup.weights_sha256): score it again with scripts/score_candidate.sh")
    return digests.pop()


def read_folder(folder: Path) -> Folder:
    """Measure -> item id -> prediction, from every run in `folder`, and the weights they scored; a run on a test
    part, and runs of different weights, are refused by name."""
    runs = sorted(folder.glob("*-predictions.jsonl"))
    if not runs:
        raise SystemExit(f"{folder} holds no harness runs (NAME-predictions.jsonl): run scripts/score_candidate.sh")
    measures: dict[Measure, dict[str, dict]] = {}
    weights: dict[str, list[str]] = {}  # digest -> the runs that scored it
    for path in runs:
        summary = path.with_name(path.name.removesuffix("-predictions.jsonl") + ".json")
        tasks = json.loads(summary.read_text())["tasks"] if summary.is_file() else {}
        for name, task in tasks.items():
            if task.get("split") in ("test", None):
                raise SystemExit(f"{summary} scored {name} on split {task.get('split')!r}: a default is chosen on "
                                 "dev parts only; score it again with --split dev")
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["task"] not in tasks:
                raise SystemExit(f"{path}: no {summary.name} beside it records the split of task {record['task']!r}")
            ratio = None if record.get("ratio") is None else float(record["ratio"])
            measure = Measure(record["task"], record["system"], ratio, Path(tasks[record["task"]]["source"]).name)
            measures.setdefault(measure, {})[str(record["id"])] = record
        weights.setdefault(run_weights(summary, tasks), []).append(summary.name)
    if len(weights) > 1:
        raise SystemExit(f"{folder} holds runs of different weights, which are never pooled: "
                         + "; ".join(f"{', '.join(names)} scored {digest}" for digest, names in weights.items())
                         + "; keep one checkpoint's runs in a folder (scripts/score_candidate.sh CHECKPOINT OUT_DIR)")
    return Folder(measures, next(iter(weights)))


def decide(baseline_runs: Folder, candidate_runs: Folder) -> dict:
    """Each shared measure's scores and paired difference, its verdict, the decision, and the weights it is about."""
    baseline, candidate = baseline_runs.measures, candidate_runs.measures
    rows = []
    for measure in sorted(set(baseline) & set(candidate), key=lambda m: (m.task, m.source, -(m.ratio or 0))):
        ids = sorted(set(baseline[measure]) & set(candidate[measure]))
        before = [baseline[measure][i] for i in ids]
        after = [candidate[measure][i] for i in ids]
        mean, se = paired_difference([item_score(r) for r in before], [item_score(r) for r in after])
        primary = (measure.task, measure.ratio) == PRIMARY
        if primary:
            verdict = "wins" if mean > NOISE * se else "does not win"
        else:
            verdict = "loses" if mean < -NOISE * se else "holds"
        rows.append({"measure": str(measure), "items": len(ids), "baseline": corpus_score(before),
                     "candidate": corpus_score(after), "paired": mean, "paired_se": se, "primary": primary,
                     "verdict": verdict})
    if not any(row["primary"] for row in rows):
        raise SystemExit(f"the folders share no {PRIMARY[0]} run at r = {PRIMARY[1]:g}, the measure a candidate must "
                         "win: run scripts/score_candidate.sh squad-s0 squad-s1 squad-s2 for both")
    missing = [str(m) for m in sorted(set(baseline) - set(candidate), key=str)]  # a measure not run is no hold
    ships = not missing and all(row["verdict"] in ("wins", "holds") for row in rows)
    weights = {"baseline": baseline_runs.weights_sha256, "candidate": candidate_runs.weights_sha256}
    return {"rows": rows, "missing": missing, "ships": ships, "weights_sha256": weights}


def table(result: dict, names: tuple[str, str]) -> str:
    lines = [f"| measure | items | {names[0]} | {names[1]} | paired | verdict |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        mark = "**" if row["primary"] else ""
        lines.append(f"| {mark}{row['measure']}{mark} | {row['items']} | {row['baseline']:.1f} | "
                     f"{row['candidate']:.1f} | {row['paired']:+.1f} ± {row['paired_se']:.1f} | {row['verdict']} |")
    decision = "ships: it replaces the default" if result["ships"] else "does not ship: the default stays"
    if result["missing"]:
        decision = (f"is not decided: the baseline's {', '.join(result['missing'])} has no candidate run beside it "
                    "(run scripts/score_candidate.sh for it); the default stays until then")
    weights = result["weights_sha256"]
    return "\n".join(lines) + (f"\n\nDecision ({NOISE:g} standard errors): the candidate {decision}.\n\nWeights scored "
                              f"(sha256, first 16 hex digits): {names[0]} {weights['baseline']}, {names[1]} "
                              f"{weights['candidate']}.\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", type=Path, help="folder of the default's dev runs")
    parser.add_argument("candidate", type=Path, help="folder of the candidate's dev runs")
    add_out_option(parser)
    args = parser.parse_args()
    result = decide(read_folder(args.baseline), read_folder(args.candidate))
    write_report(args.out, {"meta": run_meta(), "baseline": str(args.baseline), "candidate": str(args.candidate),
                            **result}, table(result, (args.baseline.name, args.candidate.name)))
    return 0 if result["ships"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

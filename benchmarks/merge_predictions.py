"""A run's predictions with some answers replaced by a rerun's (`nugget-rag eval --only-ids`): the whole run as the
rerun's settings would answer it, where they change only the answers rerun.

    python benchmarks/merge_predictions.py RUN-predictions.jsonl RERUN-predictions.jsonl --out MERGED-predictions.jsonl

Greedy decoding under `no_repeat_ngram_size=n` answers as plain greedy decoding until an answer would repeat an
n-gram, so a run's answers that repeat none stay as they are: rerunning only the others gives the whole run.
Records pair by (task, system, id); every rerun record must replace one of the run's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def key(record: dict) -> tuple[str, str, str]:
    return record["task"], record["system"], str(record["id"])


def merge(run: list[dict], rerun: list[dict]) -> list[dict]:
    """`run`'s records in order, each one `rerun` holds replaced by it."""
    replacing = {key(r): r for r in rerun}
    unknown = set(replacing) - {key(r) for r in run}
    if unknown:
        raise SystemExit(f"the rerun holds {len(unknown)} answer(s) the run does not, e.g. {sorted(unknown)[0]}: "
                         "rerun questions of the same run (its split, sample and limit, with --only-ids)")
    return [replacing.get(key(r), r) for r in run]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("rerun", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    merged = merge(read(args.run), read(args.rerun))
    args.out.write_text("".join(json.dumps(r) + "\n" for r in merged))
    print(f"{args.out}: {len(merged)} answers, {len(read(args.rerun))} from {args.rerun}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tiny data files in the shared/data formats (with a splits.json), for the evaluation harness tests."""

from __future__ import annotations

import json
from pathlib import Path

PARAGRAPHS = [
    "The falcon hunts over the river valley and dives at two hundred miles an hour.",
    "Sourdough bread needs flour, water, salt and a starter culture kept warm.",
    "Jupiter is the largest planet; its great red spot is a storm older than a century.",
    "The violin has four strings tuned in fifths and is played with a bow.",
]
QUESTIONS = [("How fast does the falcon dive?", ["two hundred miles an hour"]),
             ("What does sourdough need?", ["a starter culture"]),
             ("Which planet is the largest?", ["Jupiter"]),
             ("How many strings has a violin?", ["four"])]
TEXTS = [
    "Python lists are mutable sequences. They support indexing, slicing, appending and sorting in place. " * 2,
    "The json module encodes and decodes JSON documents. Use dumps to write a string and loads to read one. " * 2,
    "Regular expressions live in the re module; compile a pattern once and match it against many strings. " * 2,
]


def write_data(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    squad = {"data": [{"title": f"a{i}", "paragraphs": [{"context": p, "qas": [
        {"id": f"q{i}", "question": q, "answers": [{"text": a, "answer_start": 0} for a in answers]}]}]}
        for i, (p, (q, answers)) in enumerate(zip(PARAGRAPHS, QUESTIONS))]}
    (folder / "squad-dev-v1.1.json").write_text(json.dumps(squad))
    with open(folder / "cnndm-test-250.jsonl", "w") as f:
        f.writelines(json.dumps({"id": f"c{i}", "article": " ".join([p] * 3), "highlights": p.split(",")[0]}) + "\n"
                     for i, p in enumerate(PARAGRAPHS))
    hotpot = [{"_id": f"h{i}", "question": q, "answer": answers[0],
               "context": [[f"T{j}", [PARAGRAPHS[j][:60]]] for j in range(3)]} for i, (q, answers) in enumerate(QUESTIONS)]
    (folder / "hotpotqa-dev-distractor-53.json").write_text(json.dumps(hotpot))
    with open(folder / "python-3.11-docs.jsonl", "w") as f:
        f.writelines(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS * 14))
    wiki = "".join(f" = Article {i} = \n\n {t} {t}\n\n" for i, t in enumerate(TEXTS * 14))
    (folder / "wikitext-2-raw-test.txt").write_text(wiki)
    splits = {
        "squad-dev-v1.1.json": {"unit": "article", "train": [0, 1], "dev": [1, 3], "test": [3, 4]},
        "cnndm-test-250.jsonl": {"unit": "line", "train": [0, 1], "dev": [1, 3], "test": [3, 4]},
        "hotpotqa-dev-distractor-53.json": {"unit": "record", "test": "all 4"},
        "python-3.11-docs.jsonl": {"unit": "line", "test": "index % 10 == 9", "train": "all other lines"},
        "wikitext-2-raw-test.txt": {"unit": "article", "train": "first 80% of articles", "test": "last 20% of articles"},
    }
    (folder / "splits.json").write_text(json.dumps(splits))
    return folder

"""Readers for the task data formats (SQuAD JSON, summarisation JSONL, plain-text corpora, HotpotQA), with splits.

Every reader returns plain dict records in one schema per kind, so training and evaluation read the same way:
- documents: ``{"id", "text"}``
- qa: ``{"id", "context", "question", "answers": [str, ...]}``
- summarization: ``{"id", "document", "summary"}``
- multidoc_qa: ``{"id", "question", "answers": [str], "documents": [str, ...]}``

A ``splits.json`` beside a file (as in ``shared/data``) fixes its train/dev/test parts; `split=` selects one. Files
that the splits give no dev part (WikiText, Python docs) get one carved from their train part (every 20th train
unit), so that development never touches test and train never contains dev; files no splits.json names are split
the same way (every 20th unit is dev, the rest train; no test).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal

Split = Literal["train", "dev", "test"]
SPLITS_FILE = "splits.json"
_HELDOUT_EVERY = 20  # 1 in 20 train units becomes dev where splits.json names no dev part


class DataError(ValueError):
    """A data file that is missing, unreadable, or lacks the fields a task needs."""


# ------------------------------------------------------------------ splits
def split_filter(path: str | Path, split: Split | None) -> Callable[[int, int], bool]:
    """A predicate (unit index, unit count) -> kept, for `split` of `path` according to the splits.json beside it."""
    if split is None:
        return lambda i, n: True
    if split not in ("train", "dev", "test"):
        raise DataError(f"split must be 'train', 'dev' or 'test', got {split!r}")
    path = Path(path)
    table = path.parent / SPLITS_FILE
    spec = json.loads(table.read_text()).get(path.name) if table.is_file() else None
    if spec is None:  # not named in a splits.json: dev is every 20th unit, train the rest, and there is no test
        if split == "test":
            raise DataError(f"split='test' asked for {path}, but no {SPLITS_FILE} beside it names a test part")
        held = split == "dev"
        return lambda i, n: (i % _HELDOUT_EVERY == _HELDOUT_EVERY - 1) == held
    rule = _rule(spec, split, path)
    if rule is None and split == "dev" and spec.get("train") is not None:
        train = _rule(spec, "train", path)
        return lambda i, n: train(i, n) and _train_index(train, i, n) % _HELDOUT_EVERY == _HELDOUT_EVERY - 1
    if rule is None:
        raise DataError(f"{SPLITS_FILE} gives {path.name} no {split!r} part (it has {sorted(k for k in spec if k != 'unit')})")
    if split == "train" and spec.get("dev") is None:
        return lambda i, n: rule(i, n) and _train_index(rule, i, n) % _HELDOUT_EVERY != _HELDOUT_EVERY - 1
    return rule


def _train_index(rule: Callable[[int, int], bool], i: int, n: int) -> int:
    return sum(1 for j in range(i) if rule(j, n))


def _rule(spec: dict, split: str, path: Path) -> Callable[[int, int], bool] | None:
    value = spec.get(split)
    if value is None:
        return None
    if isinstance(value, list) and len(value) == 2:
        lo, hi = value
        return lambda i, n: lo <= i < hi
    if isinstance(value, str):
        text = value.lower()
        if m := re.fullmatch(r"index % (\d+) == (\d+)", text):
            mod, rem = int(m[1]), int(m[2])
            return lambda i, n: i % mod == rem
        if m := re.fullmatch(r"first (\d+)% of \w+", text):  # the exact complement of "last (100 - P)%"
            share = 1 - int(m[1]) / 100
            return lambda i, n: i < n - int(round(n * share))
        if m := re.fullmatch(r"last (\d+)% of \w+", text):
            share = int(m[1]) / 100
            return lambda i, n: i >= n - int(round(n * share))
        if text.startswith("all other"):
            others = [_rule(spec, s, path) for s in ("train", "dev", "test") if s != split and spec.get(s) is not None]
            return lambda i, n: not any(r(i, n) for r in others)
        if text.startswith("all"):
            return lambda i, n: True
    raise DataError(f"{SPLITS_FILE}: cannot read the {split!r} rule {value!r} of {path.name}")


def _select(units: list, path: Path, split: Split | None) -> list[tuple[int, object]]:
    keep = split_filter(path, split)
    return [(i, u) for i, u in enumerate(units) if keep(i, len(units))]


def _open(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} not found")
    return path


def _json_lines(path: Path) -> list[dict]:
    records = []
    # utf-8-sig: a byte-order mark is not part of line 1. Lines end at "\n" only: JSON strings may hold U+2028.
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").split("\n"), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number} is not a JSON line ({err.msg})") from err
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number} is a JSON {type(record).__name__}, not an object of fields")
            records.append(record)
    return records


def _need(record: dict, fields: tuple[str, ...], where: str) -> None:
    missing = [f for f in fields if f not in record]
    if missing:
        raise DataError(f"{where} lacks the field(s) {missing}; it has {sorted(record)}")


# ------------------------------------------------------------------ readers
def read_squad(path: str | Path, split: Split | None = None) -> list[dict]:
    """SQuAD v1.1 JSON (data[].paragraphs[].qas[]); the split unit is the article. Each record names its article and
    paragraph (indices in the file)."""
    path = _open(path)
    try:
        articles = json.loads(path.read_text(encoding="utf-8"))["data"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise DataError(f"{path} is not SQuAD-format JSON (a top-level 'data' list of articles): {err}") from err
    records = []
    for a, article in _select(articles, path, split):
        for p, paragraph in enumerate(article.get("paragraphs", [])):
            _need(paragraph, ("context", "qas"), f"{path} article {a} paragraph {p}")
            for qa in paragraph["qas"]:
                _need(qa, ("question", "answers"), f"{path} article {a} paragraph {p} question")
                records.append({
                    "id": str(qa.get("id", f"{a}-{p}-{len(records)}")),
                    "article": a,
                    "paragraph": p,
                    "context": paragraph["context"],
                    "question": qa["question"],
                    "answers": [ans["text"] for ans in qa["answers"]],
                })
    return records


def read_summarization(path: str | Path, split: Split | None = None, document_field: str = "article",
                       summary_field: str = "highlights") -> list[dict]:
    """JSONL with a document and a reference summary a line (CNN/DailyMail's article/highlights by default)."""
    path = _open(path)
    records = []
    for i, rec in _select(_json_lines(path), path, split):
        _need(rec, (document_field, summary_field), f"{path} line {i + 1}")
        records.append({"id": str(rec.get("id", i)), "document": rec[document_field], "summary": rec[summary_field]})
    return records


def read_documents(path: str | Path, split: Split | None = None, text_field: str = "text") -> list[dict]:
    """Plain-text corpora: JSONL with a text field a line, WikiText (articles at ' = Title = '), or any text file."""
    path = _open(path)
    if path.suffix in (".jsonl", ".ndjson"):
        units = _json_lines(path)
        for i, rec in enumerate(units):
            _need(rec, (text_field,), f"{path} line {i + 1}")
        return [{"id": str(rec.get("id", i)), "text": rec[text_field]} for i, rec in _select(units, path, split)]
    text = path.read_text(encoding="utf-8")
    articles = _wikitext_articles(text) if "wikitext" in path.name.lower() else [text]
    return [{"id": f"{path.name}#{i}", "text": t} for i, t in _select(articles, path, split)]


def _wikitext_articles(text: str) -> list[str]:
    """Split WikiText at its top-level headings (lines ' = Title = ', not ' = = Section = = ')."""
    articles: list[list[str]] = []
    for line in text.splitlines():
        if re.fullmatch(r" = [^=].*[^=] = ", line):
            articles.append([])
        if articles:
            articles[-1].append(line)
    return ["\n".join(lines).strip() for lines in articles]


def read_hotpotqa(path: str | Path, split: Split | None = None) -> list[dict]:
    """HotpotQA JSON (distractor setting): each question with its paragraphs, one document per paragraph, and
    `gold`: the indices of those holding its supporting facts."""
    path = _open(path)
    try:
        units = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not HotpotQA JSON: {err}") from err
    records = []
    for i, rec in _select(units, path, split):
        _need(rec, ("question", "answer", "context"), f"{path} record {i}")
        documents = [f"{title}: {''.join(sentences)}" for title, sentences in rec["context"]]
        supporting = {fact[0] for fact in rec.get("supporting_facts", [])}
        records.append({"id": str(rec.get("_id", i)), "question": rec["question"], "answers": [rec["answer"]],
                        "documents": documents,
                        "gold": [j for j, (title, _) in enumerate(rec["context"]) if title in supporting]})
    return records

"""Ready sets: the built examples of one source split, tokenised once and loaded by any machine without a tokenizer call.

A ready set is a folder (`ready_name`: the source's name and the split) holding the skip-filtered examples saved by
`datasets.Dataset.save_to_disk` (memory-mapped Arrow; token ids as uint16 where the vocabulary fits, else uint32),
and `ready.json`: the builder's portable settings and fingerprint, the tokenizer's digest, the objective and split,
the example and skip counts, and the SHA-256 of every file beside it. `load_ready` checks all of these first.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import datasets

from ..corpora import DataError
from ..state.files import sha256_file, write_atomic
from .data import ExampleBuilder

READY_FILE = "ready.json"
TOKEN_COLUMNS = ("documents", "input_ids", "prefix", "teacher_documents")


class ReadyError(DataError):
    """A ready set that does not fit this run, or whose files are damaged."""


def ready_name(source_name: str, split: str) -> str:
    """The folder of a source's split: its name (run_data.source_names) with ':' and '#' spelled '-'."""
    return re.sub(r"[^\w.-]", "-", source_name) + f"-{split}"


def _narrow(examples: datasets.Dataset, vocabulary: int) -> datasets.Dataset:
    """The examples with their token ids as uint16 (a vocabulary of at most 65536) or uint32."""
    kind = datasets.Value("uint16" if vocabulary <= 1 << 16 else "uint32")
    features = examples.features.copy()
    for column in TOKEN_COLUMNS:
        if column in features:
            nested = column.endswith("documents")
            features[column] = datasets.List(datasets.List(kind)) if nested else datasets.List(kind)
    return examples.cast(features)


def write_ready(folder: Path, examples: datasets.Dataset, skipped: Counter, builder: ExampleBuilder,
                split: str) -> dict:
    """Save built examples of `builder`'s source split as a ready set in `folder` (replaced); returns its record."""
    shutil.rmtree(folder, ignore_errors=True)
    _narrow(examples, len(builder.tok)).save_to_disk(str(folder))
    files = {f.name: sha256_file(f) for f in sorted(folder.iterdir())}
    record = {"fingerprint": builder.fingerprint(), "tokenizer": builder.tokenizer_digest,
              "objective": builder.source.objective, "split": split, "examples": len(examples),
              "skipped": dict(skipped), "settings": builder.settings(), "files": files}
    write_atomic(folder / READY_FILE, json.dumps(record, indent=1))
    return record


def find_ready(ready_dir: str | Path | None, source_name: str, split: str) -> Path | None:
    """The ready set of a source's split in `ready_dir`, or None (that split is tokenised)."""
    if ready_dir is None:
        return None
    folder = Path(ready_dir) / ready_name(source_name, split)
    return folder if (folder / READY_FILE).is_file() else None


def load_ready(folder: Path, builder: ExampleBuilder, split: str) -> tuple[datasets.Dataset, Counter]:
    """The examples of a ready set and its skip counts, after checking that it was built for this tokenizer, these
    settings and split, and that every file is whole."""
    record = json.loads((folder / READY_FILE).read_text())
    if record["tokenizer"] != builder.tokenizer_digest:
        raise ReadyError(f"{folder} was tokenised by another tokenizer (digest {record['tokenizer']}) than this "
                         f"model's ({builder.tokenizer_digest}); rebuild the ready set with this model's tokenizer "
                         "(nugget-rag train --config ... --write-ready DIR)")
    if record["split"] != split:
        raise ReadyError(f"{folder} holds split {record['split']!r}, not {split!r}; rebuild the ready set")
    if record["fingerprint"] != builder.fingerprint():
        differ = _differences(record["settings"], builder.settings())
        raise ReadyError(f"{folder} was built with other settings (fingerprint {record['fingerprint']}, this run "
                         f"{builder.fingerprint()}; differing: {', '.join(differ)}); rebuild the ready set with "
                         "this run's config")
    present = {f.name for f in folder.iterdir()} - {READY_FILE}
    if present != set(record["files"]):
        raise ReadyError(f"{folder} holds files {sorted(present)}, its {READY_FILE} lists {sorted(record['files'])}; "
                         "rebuild or re-copy it")
    for name, digest in record["files"].items():
        if sha256_file(folder / name) != digest:
            raise ReadyError(f"{folder / name}: SHA-256 differs from the one in {READY_FILE} (truncated or damaged); "
                             "rebuild or re-copy the ready set")
    return datasets.load_from_disk(str(folder)), Counter(record["skipped"])


def _differences(before: dict, now: dict, prefix: str = "") -> list[str]:
    """Dotted names of the settings whose values differ, each as 'name: set value -> this run's'."""
    out = []
    for key in sorted(set(before) | set(now)):
        a, b = before.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {json.dumps(a)} -> {json.dumps(b)}")
    return out

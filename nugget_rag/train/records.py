"""Training records: a source's files (or hub data set) read through `datasets` in one schema per objective
(`corpora`), their format told by suffix, the test parts that splits.json holds back kept out."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

from .. import corpora
from .sources import Source

_SUFFIX_FORMATS = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".txt": "text",
                   ".text": "text", ".md": "text", ".rst": "text"}
_BUILDERS = {"json": "json", "jsonl": "json", "parquet": "parquet", "text": "text"}


def resolve_format(source: Source) -> str:
    if source.format != "auto":
        return source.format
    path = Path(source.path)
    if not path.exists():
        raise corpora.DataError(f"data path {source.path} not found (for a hub data set, set format='hub')")
    files = _files(path, None)
    suffixes = {f.suffix.lower() for f in files}
    formats = {_SUFFIX_FORMATS.get(s) for s in suffixes}
    if len(formats) != 1 or None in formats:
        raise corpora.DataError(f"cannot tell the format of {source.path} (suffixes {sorted(suffixes)}); set format=")
    fmt = formats.pop()
    if fmt == "json" and path.is_file():
        head = path.open(encoding="utf-8").read(4096).lstrip()
        if head.startswith("{") and '"data"' in head[:200] and '"paragraphs"' in head:
            return "squad"
        if head.startswith("[") and '"supporting_facts"' in head:
            return "hotpotqa"
    return fmt


def _files(path: Path, fmt: str | None) -> list[Path]:
    if path.is_file():
        return [path]
    suffixes = [s for s, f in _SUFFIX_FORMATS.items() if fmt is None or f == fmt or (fmt == "json" and f == "jsonl")]
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
    if not files:
        raise corpora.DataError(f"{path} holds no data files ({', '.join(suffixes)})")
    return files


def _splits_entry(path: Path) -> dict | None:
    """The splits.json entry of a file (as in ../shared/data), or None."""
    table = path.parent / corpora.SPLITS_FILE
    if not (path.is_file() and table.is_file()):
        return None
    return json.loads(table.read_text()).get(path.name)


def _guard_test_part(source: Source, fmt: str, split: str | None, entry: dict | None) -> None:
    """A file whose splits.json `entry` names a test part is read only by part, and in the units those parts
    count; a folder holding such a file is refused."""
    path = Path(source.path)
    if path.is_dir():
        held = [f.name for f in _files(path, fmt) if (_splits_entry(f) or {}).get("test") is not None]
        if held:
            raise corpora.DataError(f"{path} holds {', '.join(held)}, which {corpora.SPLITS_FILE} gives a test part; "
                                    "name each file as its own source, so that only its part is read")
        return
    if entry is None or entry.get("test") is None:
        return
    native = resolve_format(source.model_copy(update={"format": "auto"}))
    if fmt != native and {"squad", "hotpotqa"} & {fmt, native}:  # their readers count other units than lines
        raise corpora.DataError(f"{path.name} is split by {corpora.SPLITS_FILE} in units of its {native} format; read "
                                f"it with format=auto, not format={fmt}, so that its test part stays out")
    if split is None:
        raise corpora.DataError(f"split=None would read all of {path.name}, its test part included; use split='train'")


def load_records(source: Source, split: str | None) -> datasets.Dataset | datasets.IterableDataset:
    """The raw records of `split` of a source, in one schema per objective (see `corpora`)."""
    fmt = resolve_format(source)
    path = Path(source.path)
    entry = _splits_entry(path) if fmt != "hub" else None
    if fmt != "hub":
        _guard_test_part(source, fmt, split, entry)
    if fmt == "squad":
        return datasets.Dataset.from_list(corpora.read_squad(path, split))
    if fmt == "hotpotqa":
        return datasets.Dataset.from_list(corpora.read_hotpotqa(path, split))
    if entry is not None:  # a file of ../shared/data: its splits.json decides
        if source.objective == "summarization":
            records = corpora.read_summarization(path, split, source.document_field, source.summary_field)
        else:
            records = corpora.read_documents(path, split, source.text_field)
        return datasets.Dataset.from_list(records)
    if fmt == "hub":
        data = datasets.load_dataset(source.path, split=split or "train", streaming=source.streaming)
    else:
        files = [str(f) for f in _files(path, fmt)]
        data = datasets.load_dataset(_BUILDERS[fmt], data_files=files, split="train", streaming=source.streaming)
        if split is not None:
            keep = corpora.split_filter(path, split)
            data = data.filter(lambda _, i: keep(i, 0), with_indices=True)
    return data

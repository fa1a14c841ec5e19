"""Documents from files, folders and JSONL, for `nugget-rag ingest`."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from langchain_core.documents import Document

log = logging.getLogger(__name__)

JSONL_SUFFIXES = {".jsonl", ".ndjson"}
_SNIFF_BYTES = 8192


class DocumentLoadError(ValueError):
    """A path that does not exist or a file that cannot be read as text / JSONL."""


class LoadReport(NamedTuple):
    """The documents read, and each file skipped with the reason (empty, not UTF-8, unreadable, bad JSONL)."""

    documents: list[Document]
    skipped: dict[str, str]


def load_documents(paths: Sequence[str | Path]) -> list[Document]:
    """Documents from files (any UTF-8 text), folders (their text files, recursively) and JSONL files.

    A JSONL line is an object with a "text" field and optional "id", "title", "source"; the "id" (else
    "source", else file:line) becomes the document's source. Missing paths are all named in one error, and so is
    the first file that cannot be read; empty files are skipped with a warning.
    """
    docs: list[Document] = []
    for path in _files(paths):
        docs.extend(_load_file(path))
    return docs


def read_documents(paths: Sequence[str | Path]) -> LoadReport:
    """`load_documents`, but a file that is empty or cannot be read is skipped and named in the report, and the rest
    is read; missing paths are still one error, before anything is read."""
    docs: list[Document] = []
    skipped: dict[str, str] = {}
    for path in _files(paths):
        try:
            found = list(_load_file(path))
        except (DocumentLoadError, OSError, UnicodeDecodeError) as err:
            skipped[str(path)] = str(err)
            continue
        if not found:
            skipped[str(path)] = "empty"
        docs.extend(found)
    return LoadReport(docs, skipped)


def _files(paths: Sequence[str | Path]) -> Iterator[Path]:
    """The files `paths` name: each file, and the text and JSONL files of each folder (recursively, sorted)."""
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise DocumentLoadError(f"no such file or directory: {', '.join(missing)}")
    for path in map(Path, paths):
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file() and not _hidden(f.relative_to(path)))
            kept = [f for f in files if f.suffix.lower() in JSONL_SUFFIXES or _looks_like_text(f)]
            log.info("%s: %d text files of %d", path, len(kept), len(files))
            yield from kept
        else:
            yield path


def _load_file(path: Path) -> Iterator[Document]:
    if path.suffix.lower() in JSONL_SUFFIXES:
        yield from load_jsonl(path)
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DocumentLoadError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from err
    except OSError as err:
        raise DocumentLoadError(f"cannot read {path}: {err.strerror}") from err
    if text.strip():
        yield Document(page_content=text, metadata={"source": str(path)})
    else:
        log.warning("%s is empty; skipped", path)


def load_jsonl(path: str | Path) -> Iterator[Document]:
    """One Document per JSONL line {"text", optional "id", "title", "source"}; blank lines are skipped."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DocumentLoadError(f"{path}:{lineno} is not valid JSON ({err.msg})") from err
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DocumentLoadError(f"{path}:{lineno} needs a JSON object with a string \"text\" field")
            meta = {k: str(record[k]) for k in ("id", "title", "source") if record.get(k) is not None}
            meta["source"] = meta.get("id") or meta.get("source") or f"{path}:{lineno}"
            if record["text"].strip():
                yield Document(page_content=record["text"], metadata=meta)


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _looks_like_text(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        return err.start >= len(head) - 3  # a multi-byte character cut by the sniff window
    return True

"""The files of a saved NuggetIndex, and the lock that makes its updates take turns.

One directory holds everything (no pickle anywhere)::

    index.json              manifest: embedding model, dimension, vector store, nugget model fingerprint, chunking,
                            and the names and sha256 of the two files below
    index-<sha>.faiss       the FAISS vectors (faiss.serialize_index); absent when the vectors live in the user's
                            own vector store (`NuggetIndex(..., vectorstore=...)`)
    docstore-<sha>.json     the chunks (id, page_content, metadata) in index order
    nuggets/                the NuggetStore of the chunks (content-addressed NuggetStates)
    index.lock              held while a process updates the index

A save writes new content-named files, then replaces the manifest (the commit), then deletes the files the old
manifest named: a crash at any point leaves the old or the new index, whole. Indexes saved before the manifest
named its files (plain `index.faiss`, `docstore.json`) still load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from langchain_core.documents import Document

from nugget_rag.cancellation import check
from nugget_rag.state.files import fsync_directory, write_atomic
from nugget_rag.state.store import NuggetStore

log = logging.getLogger(__name__)

INDEX_FORMAT = "nugget-rag/index-v1"
MANIFEST_FILE = "index.json"
LEGACY_FILES = {"faiss": {"name": "index.faiss"}, "docstore": {"name": "docstore.json"}}
NUGGETS_DIR = "nuggets"
LOCK_FILE = "index.lock"  # held by NuggetIndex.updating
LOCK_POLL_S = 0.5  # how often a wait for another process's update checks whether its request was cancelled


class IndexFileError(ValueError):
    """A file of a saved NuggetIndex is truncated, malformed or inconsistent with the others."""


# ---------------------------------------------------------------------------------------------- reading
def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    """The manifest of the index saved in `directory` (its settings: r, chunking, embeddings), or None if none."""
    path = Path(directory) / MANIFEST_FILE
    return read_json(path) if path.exists() else None


def read_records(directory: str | Path, manifest: dict[str, Any]) -> tuple[dict[str, Document], list[str]]:
    """The chunks saved in `directory` (id -> Document) and their ids in index order, checked against `manifest`."""
    directory = Path(directory)
    files = data_files(manifest, directory)
    if "docstore" not in files:
        raise IndexFileError(f"{directory / MANIFEST_FILE} counts {manifest.get('count')} chunks but names no "
                             "docstore; ingest the documents again into a new directory")
    docstore_path = directory / files["docstore"]["name"]
    data = _parse_json(docstore_path, read_content(docstore_path, files["docstore"].get("sha256")))
    try:
        docs = {d["id"]: Document(id=d["id"], page_content=d["page_content"], metadata=d["metadata"])
                for d in data["documents"]}
        order = list(data["index_to_docstore_id"])
    except (KeyError, TypeError) as err:
        raise IndexFileError(f"{docstore_path} is malformed (missing {err}); "
                             "ingest the documents again into a new directory") from err
    if len(order) != manifest.get("count"):
        raise IndexFileError(f"{docstore_path} maps {len(order)} chunks and {directory / MANIFEST_FILE} counts "
                             f"{manifest.get('count')}: the files do not belong together")
    missing = [i for i in order if i not in docs]
    if missing:
        raise IndexFileError(f"{docstore_path} maps chunk ids it does not hold, e.g. {missing[0]}")
    return docs, order


def data_files(manifest: dict[str, Any], directory: Path) -> dict[str, dict[str, str]]:
    """The manifest's {"faiss": {"name", "sha256"}, "docstore": {...}}: plain file names inside `directory`."""
    files = manifest.get("files", LEGACY_FILES)
    try:
        names = [f["name"] for f in files.values()]
    except (AttributeError, KeyError, TypeError) as err:
        raise IndexFileError(f"{directory / MANIFEST_FILE} has a malformed list of files ({err!r})") from err
    if any(not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..") for n in names):
        raise IndexFileError(f"{directory / MANIFEST_FILE} names files outside its directory: {names}")
    return files


def read_content(path: Path, sha256: str | None) -> bytes:
    """The bytes of a data file, checked against the sha256 the manifest records of it (when it records one)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the index in {path.parent} is incomplete; "
                                "ingest the documents again into a new directory")
    data = path.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise IndexFileError(f"{path} is truncated or altered (its sha256 is not the one {MANIFEST_FILE} records); "
                             "ingest the documents again into a new directory")
    return data


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path` (a manifest), or a FileNotFoundError / IndexFileError naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {path.parent} is not a complete nugget-rag index "
                                "(`nugget-rag ingest ... --index DIR` writes one)")
    return _parse_json(path, path.read_bytes())


def _parse_json(path: Path, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise IndexFileError(f"{path} is truncated or not valid JSON ({err}); "
                             "ingest the documents again into a new directory") from err
    if not isinstance(value, dict):
        raise IndexFileError(f"{path} does not hold a JSON object")
    return value


# ---------------------------------------------------------------------------------------------- writing
def encode_records(documents: Sequence[Document], ids: Sequence[str], directory: Path) -> bytes:
    """The docstore file's bytes: the chunks and their `ids` in index order; a ValueError naming `directory` when a
    chunk's metadata is not JSON (checked before anything is written)."""
    docs = [{"id": d.id, "page_content": d.page_content, "metadata": d.metadata} for d in documents]
    try:
        return json.dumps({"format": INDEX_FORMAT, "documents": docs, "index_to_docstore_id": list(ids)},
                          ensure_ascii=False).encode()
    except (TypeError, ValueError) as err:
        raise ValueError(f"the index cannot be saved: a chunk's metadata is not JSON ({err}); nothing was "
                         f"written to {directory}") from err


def write_index(directory: Path, manifest: dict[str, Any], docstore: bytes, vectors: bytes | None) -> None:
    """Write the docstore and (for the index's own FAISS) the vectors under content names, commit the manifest that
    names them, then delete the files the replaced manifest named."""
    replaced = _saved_files(directory)
    files = {"docstore": _write_content(directory, "docstore", ".json", docstore)}
    if vectors is not None:
        files["faiss"] = _write_content(directory, "index", ".faiss", vectors)
    _write_json(directory / MANIFEST_FILE, {**manifest, "files": files})  # the commit
    fsync_directory(directory)
    for name in replaced - {f["name"] for f in files.values()}:
        (directory / name).unlink(missing_ok=True)


def _write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, ensure_ascii=False).encode())


def _write_content(directory: Path, stem: str, suffix: str, data: bytes) -> dict[str, str]:
    """Write `data` under a name of its digest (never over another save's file); its name and sha256."""
    digest = hashlib.sha256(data).hexdigest()
    path = directory / f"{stem}-{digest[:16]}{suffix}"
    write_atomic(path, data)  # also when the name exists: that file may have been damaged since
    return {"name": path.name, "sha256": digest}


def _saved_files(directory: Path) -> set[str]:
    """The data files the manifest in `directory` names (none when there is no readable manifest)."""
    try:
        files = data_files(read_json(directory / MANIFEST_FILE), directory)
    except (FileNotFoundError, IndexFileError):
        return set()
    return {f["name"] for f in files.values()}


# ---------------------------------------------------------------------------------------------- the nuggets' store
def index_location(directory: str | Path) -> str:
    """"HOST:PATH": how a nugget store names an index saved over it (NuggetStore.register_index)."""
    return f"{socket.gethostname()}:{Path(directory).resolve()}"


def keeps_store(store: NuggetStore, directory: Path) -> bool:
    """Whether an index in `directory` keeps `store` for its nuggets: its own `nuggets/`, or a shared Redis store."""
    location = store.location
    return location is not None and (location.is_redis or location.directory == directory.resolve())


def store_name(store: NuggetStore) -> str:
    """What the manifest records of the nuggets' store: "redis:<namespace>" (never the URL: it may hold a password)
    or "directory" (the index's `nuggets/`)."""
    location = store.location
    return f"redis:{location.namespace}" if location is not None and location.is_redis else "directory"


# ---------------------------------------------------------------------------------------------- the lock
@contextmanager
def index_lock(directory: Path) -> Iterator[None]:
    """Hold the lock of the index in `directory`, waiting (and logging that) while another process holds it; a
    cancelled request (cancellation.py) stops waiting."""
    lock = FileLock(directory / LOCK_FILE)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("another process is updating the index in %s; waiting for it to finish", directory)
        while not lock.is_locked:
            check()
            try:
                lock.acquire(timeout=LOCK_POLL_S)
            except Timeout:
                pass
    try:
        yield
    finally:
        lock.release()


__all__: list[str] = [
    "INDEX_FORMAT", "LOCK_FILE", "MANIFEST_FILE", "NUGGETS_DIR", "IndexFileError", "data_files", "encode_records",
    "index_location", "index_lock", "keeps_store", "read_content", "read_json", "read_manifest", "read_records",
    "store_name", "write_index",
]

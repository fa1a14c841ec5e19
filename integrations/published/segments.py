"""How an index is published in a nugget store's ByteStore (beside the nuggets), and how a version of it is read whole.

Every key of the index named NAME lies under `published-index/NAME/`::

    current                 the pointer: the current version's number and the sha256 of its record (one small
                            value, replaced whole: the commit of a publish)
    versions/<n>            a version record: the index's manifest (embeddings, nugget model, chunking) and the list
                            of its segments, in index order, each with its sha256 and number of chunks
    segments/<sha256>       a segment: a run of consecutive chunks and their unit vectors (JSON, then float32);
                            immutable and named by its content, so versions share them
    pending                 the segments a publish is writing (removed by the next one, should it have crashed)

A reader reads the pointer, then the record it names, then the segments the record lists, checking each against the
sha256 that names it, and builds the whole version before it is used. Nothing is code: JSON and float32 numbers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from langchain_core.documents import Document
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nugget_rag.state.files import write_atomic
from nugget_rag.state.store import NuggetStore, StoreUnavailableError

from ..local.files import IndexFileError

log = logging.getLogger(__name__)

PREFIX = "published-index"
NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
VERSION_FORMAT = "nugget-rag/published-index-v1"
Segment = tuple[list[Document], np.ndarray]  # a segment's chunks and their vectors (count x dimension)
SEGMENT_MAGIC = b"nugget-rag/index-segment-v1\n"
HEADER_BYTES = 8  # the length of a segment's JSON part, big-endian


class DamagedIndexError(IndexFileError):
    """A part (`key`) that version `version` of a published index lists is "missing" from the store, or "altered":
    no retry helps; `nugget-rag index check --repair` does."""

    def __init__(self, message: str, kind: str, key: str, version: int):
        super().__init__(message)
        self.kind, self.key, self.version = kind, key, version


class VersionRemovedError(LookupError):
    """A version (or one of its segments) is no longer in the store: removed while it was read, as a newer one was
    published (a race), unless the pointer still names it: then `damage` says what is missing."""

    def __init__(self, message: str, damage: DamagedIndexError):
        super().__init__(message)
        self.damage = damage


class SegmentRef(BaseModel):
    """A segment as a version record lists it."""

    model_config = ConfigDict(frozen=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    count: int = Field(ge=1)
    nbytes: int = Field(ge=1)
    sources: list[str] = []  # its chunks' sources: what to ingest again should the segment be lost


class VersionRecord(BaseModel):
    """A published version: its manifest (NuggetIndex.manifest) and its segments, whose chunks add up to `count`."""

    model_config = ConfigDict(frozen=True)

    format: Literal[VERSION_FORMAT] = VERSION_FORMAT
    name: str
    version: int = Field(ge=1)
    count: int = Field(ge=0)
    dimension: int | None = Field(None, ge=1)
    manifest: dict[str, Any]
    segments: list[SegmentRef]


class Pointer(BaseModel):
    """The current version: its number, its record's sha256, the earlier versions still kept for readers that are
    loading them, and those retired when it was published (removed then, and again by the next publish); the
    versions the index keeps (PublishOptions.keep_versions; None: a pointer written before it was recorded)."""

    model_config = ConfigDict(frozen=True)

    format: Literal[VERSION_FORMAT] = VERSION_FORMAT
    version: int = Field(ge=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    kept: list[int] = []
    retired: list[int] = []
    keep_versions: int | None = Field(None, ge=1)


# ---------------------------------------------------------------------------------------------- keys
def check_name(name: str) -> str:
    """`name` if it names a published index, else a ValueError naming it and the fix."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"published index name {name!r} is not 1-64 lowercase letters, digits, '_' or '-' "
                         "(starting with a letter or digit); give e.g. 'default' or 'docs-2024'")
    return name


def published_location(name: str) -> str:
    """How the nugget store's register of indexes (NuggetStore.register_index, what prune keeps) names the index
    published as `name`: its keys' prefix (no host name holds a "/")."""
    return f"{PREFIX}/{name}"


def pointer_key(name: str) -> str:
    return f"{PREFIX}/{name}/current"


def version_key(name: str, version: int) -> str:
    return f"{PREFIX}/{name}/versions/{version:010d}"


def segment_key(name: str, sha256: str) -> str:
    return f"{PREFIX}/{name}/segments/{sha256}"


def pending_key(name: str) -> str:
    return f"{PREFIX}/{name}/pending"


def describe(store: NuggetStore) -> str:
    """The store for messages: its location (without a password), or its ByteStore's type."""
    return str(store.location) if store.location is not None else type(store.byte_store).__name__


def repair_command(store: NuggetStore, name: str) -> str:
    """The command that checks and repairs the index `name` in `store`."""
    return f"nugget-rag index check --store '{describe(store)}' --name {name} --repair"


def damaged(store: NuggetStore, name: str, version: int, key: str, kind: str) -> DamagedIndexError:
    """The error of a part (`key`) of `version` that is "missing" or "altered", naming the repair."""
    what = "missing" if kind == "missing" else "altered (its sha256 is not the one it is named by: truncated or " \
        "changed)"
    return DamagedIndexError(f"{key} in the nugget store {describe(store)} is {what}; version {version} of the index "
                             f"{name!r} lists it. Publishing again does not mend it: run "
                             f"`{repair_command(store, name)}`", kind, key, version)


def intact(data: bytes | None, ref: SegmentRef) -> bool:
    """Whether `data` is the segment `ref` names (its sha256)."""
    return data is not None and hashlib.sha256(data).hexdigest() == ref.sha256


# ---------------------------------------------------------------------------------------------- the store
def get(store: NuggetStore, key: str) -> bytes | None:
    """The value at `key`, or None; a StoreUnavailableError naming the store when it cannot be read."""
    try:
        return store.byte_store.mget([key])[0]
    except Exception as err:
        raise StoreUnavailableError(f"could not read {key} from the nugget store {describe(store)}: {err}; "
                                    "start the server or fix the store's URL") from err


def redis_key(store: NuggetStore, key: str) -> str:
    """The Redis key at which the store's RedisStore keeps `key` (its namespace, "/", the key; as its
    _get_prefixed_key)."""
    namespace = store.byte_store.namespace
    return f"{namespace}/{key}" if namespace else key


def put(store: NuggetStore, key: str, value: bytes) -> None:
    try:
        store.byte_store.mset([(key, value)])
    except Exception as err:
        raise StoreUnavailableError(f"could not write {key} to the nugget store {describe(store)}: {err}; the "
                                    "published index is as it was: make the store take writes (its memory, disk, "
                                    "permissions), then publish again") from err


def delete(store: NuggetStore, keys: Sequence[str]) -> None:
    if keys:
        try:
            store.byte_store.mdelete(list(keys))
        except Exception as err:
            raise StoreUnavailableError(f"could not delete {len(keys)} keys of a published index from the nugget "
                                        f"store {describe(store)}: {err}") from err


def read_pointer(store: NuggetStore, name: str) -> tuple[bytes, Pointer] | None:
    """The current version's pointer (its bytes, to compare cheaply, and its value), or None: nothing published."""
    data = get(store, pointer_key(name))
    return None if data is None else (data, parse(Pointer, data, pointer_key(name), store))


def parse(model: type[BaseModel], data: bytes, key: str, store: NuggetStore) -> Any:
    """`data` (JSON) as a `model`, or an IndexFileError naming `key`."""
    try:
        return model.model_validate_json(data)
    except ValidationError as err:
        raise IndexFileError(f"{key} in the nugget store {describe(store)} is malformed ({err.errors()[0]['msg']}); "
                             "publish the index again, or under another name") from err


def read_record(store: NuggetStore, name: str, version: int, sha256: str | None = None) -> VersionRecord:
    """The record of `version`, checked against the `sha256` its pointer names; VersionRemovedError if it is gone."""
    key = version_key(name, version)
    data = get(store, key)
    if data is None:
        raise VersionRemovedError(f"{key} is no longer in the nugget store {describe(store)}",
                                  damaged(store, name, version, key, "missing"))
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise IndexFileError(f"{key} in the nugget store {describe(store)} is not the record its pointer names (its "
                             f"sha256 differs): truncated or altered; run `{repair_command(store, name)}`")
    record = parse(VersionRecord, data, key, store)
    if (record.name, record.version) != (name, version):
        raise IndexFileError(f"{key} in the nugget store {describe(store)} holds the record of {record.name!r} "
                             f"version {record.version}, not of {name!r} version {version}")
    counted = sum(s.count for s in record.segments)
    if counted != record.count or record.manifest.get("count") != record.count:
        raise IndexFileError(f"{key} in the nugget store {describe(store)} counts {record.count} chunks, its manifest "
                             f"{record.manifest.get('count')} and its segments {counted}: they do not belong together")
    if record.manifest.get("dimension") != record.dimension:
        raise IndexFileError(f"{key} in the nugget store {describe(store)} gives vectors of dimension "
                             f"{record.dimension}, its manifest {record.manifest.get('dimension')}: they do not belong "
                             "together")
    return record


# ---------------------------------------------------------------------------------------------- segments
def encode_segment(chunks: Sequence[Document], vectors: np.ndarray) -> bytes:
    """A segment's bytes: `chunks` (id, text, metadata) and their unit `vectors` (count x dimension); a ValueError
    when a chunk's metadata is not JSON."""
    records = [{"id": d.id, "page_content": d.page_content, "metadata": d.metadata} for d in chunks]
    try:
        header = json.dumps({"count": len(chunks), "dimension": int(vectors.shape[1]), "chunks": records},
                            ensure_ascii=False).encode()
    except (TypeError, ValueError) as err:
        raise ValueError(f"the index cannot be published: a chunk's metadata is not JSON ({err}); nothing was "
                         "published") from err
    return SEGMENT_MAGIC + len(header).to_bytes(HEADER_BYTES, "big") + header + vectors.astype("<f4").tobytes()


def sources_of(chunks: Sequence[Document]) -> list[str]:
    """The sources of `chunks` (their documents' "source", else the chunk's id), each once, in order."""
    return list(dict.fromkeys(str(d.metadata.get("source") or f"chunk {d.id}") for d in chunks))


def decode_segment(data: bytes, ref: SegmentRef, dimension: int | None, where: str) -> Segment:
    """The chunks and vectors of a segment `intact` already, checked against its `ref` (count) and the version's
    `dimension`; an IndexFileError naming `where` (its key) otherwise."""
    start = len(SEGMENT_MAGIC) + HEADER_BYTES
    if not data.startswith(SEGMENT_MAGIC) or len(data) < start:
        raise IndexFileError(f"{where} is not a segment of a published nugget-rag index")
    end = start + int.from_bytes(data[len(SEGMENT_MAGIC):start], "big")
    try:
        header = json.loads(data[start:end].decode("utf-8"))
        chunks = [Document(id=c["id"], page_content=c["page_content"], metadata=c["metadata"])
                  for c in header["chunks"]]
        count, found = int(header["count"]), int(header["dimension"])
    except (ValueError, KeyError, TypeError) as err:
        raise IndexFileError(f"{where} has a malformed header ({err!r}); publish the index again") from err
    if dimension is not None and found != dimension:
        raise IndexFileError(f"{where} holds vectors of dimension {found}, its version record says {dimension}: "
                             "they do not belong together")
    if not count == len(chunks) == ref.count or len(data) - end != count * found * 4:
        raise IndexFileError(f"{where} holds {len(chunks)} chunks and {(len(data) - end) // max(found * 4, 1)} "
                             f"vectors, its version record counts {ref.count}: they do not belong together")
    return chunks, np.frombuffer(data, dtype="<f4", offset=end).reshape(count, found)


class SegmentCache:
    """Segments kept in a local directory, named by their sha256 (checked when read): a cache of the store's."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def get(self, sha256: str) -> bytes | None:
        try:
            data = (self.directory / f"{sha256}.segment").read_bytes()
        except FileNotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() == sha256:
            return data
        log.warning("the cached segment %s is damaged: it is read from the store instead", self.directory / sha256)
        return None

    def put(self, sha256: str, data: bytes) -> None:
        write_atomic(self.directory / f"{sha256}.segment", data)

    def keep(self, sha256s: set[str]) -> None:
        """Remove the cached segments but those of `sha256s` (the version loaded last)."""
        for path in self.directory.glob("*.segment"):
            if path.stem not in sha256s:
                path.unlink(missing_ok=True)


def read_version(store: NuggetStore, name: str, version: int, sha256: str | None, cache: SegmentCache | None = None,
                 loaded: Callable[[SegmentRef], Segment | None] | None = None) -> tuple[VersionRecord, list[Document],
                                                                                      np.ndarray]:
    """`version` whole: its record (checked against the `sha256` its pointer names), its chunks in index order and
    their vectors, every part checked (sha256, counts, dimension, ids). A segment is taken from `loaded` (the chunks
    and vectors of a segment of that sha256 held already), else from `cache`, else from the store.
    VersionRemovedError if a part was removed meanwhile."""
    record = read_record(store, name, version, sha256)
    chunks: list[Document] = []
    vectors: list[np.ndarray] = []
    for ref in record.segments:
        found = loaded(ref) if loaded is not None else None
        if found is None:
            key = segment_key(name, ref.sha256)
            data = cache.get(ref.sha256) if cache is not None else None
            if data is None:
                data = get(store, key)
                if data is None:
                    raise VersionRemovedError(f"{key} is no longer in the nugget store {describe(store)}",
                                              damaged(store, name, version, key, "missing"))
                if not intact(data, ref):
                    raise damaged(store, name, version, key, "altered")
                if cache is not None:
                    cache.put(ref.sha256, data)
            found = decode_segment(data, ref, record.dimension, f"{key} in {describe(store)}")
        chunks += found[0]
        vectors.append(found[1])
    if len({d.id for d in chunks}) != len(chunks):
        raise IndexFileError(f"version {record.version} of the index {name!r} in {describe(store)} holds a chunk id "
                             "twice; publish the index again")
    if cache is not None:
        cache.keep({ref.sha256 for ref in record.segments})
    dimension = record.dimension or 1
    return record, chunks, np.concatenate(vectors) if vectors else np.zeros((0, dimension), np.float32)


__all__: list[str] = [
    "PREFIX", "DamagedIndexError", "Pointer", "Segment", "SegmentCache", "SegmentRef", "VersionRecord",
    "VersionRemovedError", "check_name", "damaged", "decode_segment", "delete", "describe", "encode_segment", "get",
    "intact", "pending_key", "pointer_key", "published_location", "put", "read_pointer", "read_record",
    "read_version", "redis_key", "repair_command", "segment_key", "sources_of", "version_key",
]

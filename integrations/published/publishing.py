"""Publishing a version of an index in a nugget store (the layout: segments.py), one publisher at a time.

A publish appends: the chunks a version adds go into new segments, the earlier ones stay as they are, so that a
large index is not rewritten at every ingest. When more than `max_small_segments` segments are small (under a
quarter of `segment_bytes`), runs of adjacent ones are merged (compaction); `compact=True` merges every run that
fits. Segments are written first, then the version record, then the pointer (the commit): a publish that fails or
crashes before the pointer leaves the previous version current and whole.

The pointer keeps the `keep_versions - 1` versions before the current one, so that a reader still loading one finds
it whole; older versions, and the segments only they list, are removed once the pointer has moved on. Publishers take
turns under a lock: Redis's (a key that expires, should its holder die), a file lock beside a directory store, or a
lock of this process for any other ByteStore (lock.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence

from langchain_core.documents import Document
from pydantic import BaseModel, Field, field_validator

from nugget_rag.cancellation import check
from nugget_rag.state.store import NuggetStore

from ..local.files import IndexFileError
from ..local.index import NuggetIndex
from ..local.own_faiss import faiss_vectors
from .lock import PublishLock
from .segments import (
    Pointer,
    SegmentCache,
    SegmentRef,
    VersionRecord,
    VersionRemovedError,
    check_name,
    delete,
    describe,
    encode_segment,
    get,
    pending_key,
    pointer_key,
    published_location,
    put,
    read_pointer,
    read_record,
    read_version,
    segment_key,
    sources_of,
    version_key,
)
from .verify import check_sizes, verify_listed

log = logging.getLogger(__name__)



Published = tuple[bytes, Pointer, VersionRecord]  # a version published: its pointer (bytes and value) and record
Committed = Callable[[bytes, Pointer, VersionRecord], None]


class PublishOptions(BaseModel):
    """Where an index is published in the store, and how its versions and segments are kept."""

    name: str = Field("default", description="the index's name in the store (1-64 of [a-z0-9_-])")
    keep_versions: int = Field(2, ge=1, description="versions kept: the current one and those before it, for "
                               "readers still loading them")
    segment_bytes: int = Field(32 * 2**20, ge=2**12, le=256 * 2**20, description="the most bytes of one segment "
                               "(Redis refuses values over 512 MB)")
    max_small_segments: int = Field(8, ge=1, description="small segments (under segment_bytes / 4) kept before "
                                    "adjacent ones are merged")
    load_attempts: int = Field(3, ge=1, description="how often a reader loads again when the version it loads is "
                               "removed meanwhile")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value)




# ---------------------------------------------------------------------------------------------- publishing
def publish_version(store: NuggetStore, options: PublishOptions, base: tuple[Pointer, VersionRecord] | None,
                    index: NuggetIndex, appended_from: int, lock: PublishLock, compact: bool = False,
                    cache: SegmentCache | None = None, committed: Committed | None = None) -> Published:
    """Publish `index` (its own FAISS) as the version after `base` (the current one, None: the first), under `lock`.
    Its first `appended_from` chunks are `base`'s, whose segments it keeps (0: every segment is written anew); the
    segments written go into `cache` too. Returns the new pointer (bytes and value) and record, also given to
    `committed` as soon as the pointer is written (commit_version)."""
    name = options.name
    if base is not None and appended_from == base[1].count:
        refs, start = list(base[1].segments), base[1].count
    else:
        refs, start = [], 0
    chunks, dimension = index.documents, index.dimension
    spans: list[tuple[int, int]] = []  # each segment's chunk positions [a, b)
    for ref in refs:
        a = spans[-1][1] if spans else 0
        spans.append((a, a + ref.count))
    new: dict[str, bytes] = {}

    def encoded(a: int, b: int) -> bytes:
        return encode_segment(chunks[a:b], faiss_vectors(index.vectorstore, a, b))

    def segment(a: int, b: int) -> SegmentRef:
        data = encoded(a, b)
        ref = SegmentRef(sha256=_sha256(data), count=b - a, nbytes=len(data), sources=sources_of(chunks[a:b]))
        new[ref.sha256] = data
        return ref

    for a, b in chunk_runs(chunks[start:], dimension or 0, options.segment_bytes):
        refs.append(segment(start + a, start + b))
        spans.append((start + a, start + b))
    merged: list[SegmentRef] = []
    for group in merge_groups(refs, options, compact):
        merged.append(refs[group[0]] if len(group) == 1 else segment(spans[group[0]][0], spans[group[-1]][1]))
    version = 1 if base is None else base[0].version + 1
    record = VersionRecord(name=name, version=version, count=len(chunks), dimension=dimension,
                           manifest=index.manifest(), segments=merged)
    listed = {ref.sha256 for ref in merged}
    writes = {sha: data for sha, data in new.items() if sha in listed}
    copies = {ref.sha256: (lambda i=i: encoded(*spans[i])) for i, ref in enumerate(refs)}
    check()  # the last point a cancelled request stops at: what follows is quick, and lands whole
    writes |= verify_listed(store, name, base, [ref for ref in merged if ref.sha256 not in new], copies, cache)
    published = commit_version(store, options, None if base is None else base[0], record, writes, lock, cache,
                               committed=committed, held=None if base is None else base[1])
    log.info("published version %d of the index %r in %s: %d chunks in %d segments (%d written)", version, name,
             describe(store), record.count, len(merged), len(writes))
    return published


def commit_version(store: NuggetStore, options: PublishOptions, base: Pointer | None, record: VersionRecord,
                   writes: dict[str, bytes], lock: PublishLock, cache: SegmentCache | None = None,
                   broken: Sequence[int] = (), committed: Committed | None = None,
                   held: VersionRecord | None = None) -> Published:
    """Write the segments `writes` (by sha256), then `record`, then the pointer to it (the commit), keeping the
    versions before it that `options` keeps but those `broken`, and call `committed` (so that this process's
    readers take the new version now, not load it themselves while the rest runs); then remove the versions retired
    and what only they list. A write the store refuses leaves the version before current, and the segments written
    are removed again where the store lets. `base` is the pointer read under `lock`; `held`, the record this process
    holds of its version, is not read again when it is the one `base` names (its version and sha256)."""
    name, version = options.name, record.version
    if held is not None and (base is None or held.version != base.version
                             or _sha256(held.model_dump_json().encode()) != base.sha256):
        held = None  # not the record the pointer names: read it
    earlier = [] if base is None else [*base.kept, base.version]
    whole = [v for v in earlier if v not in broken]
    kept = whole[len(whole) - (options.keep_versions - 1):] if options.keep_versions > 1 else []
    listed = {ref.sha256 for ref in record.segments}
    check_sizes(store, options.segment_bytes, record, writes)
    _remove_pending(store, name, base, held)
    put(store, pending_key(name), json.dumps(list(writes)).encode())
    record_bytes = record.model_dump_json().encode()
    pointer = Pointer(version=version, sha256=_sha256(record_bytes), kept=kept,
                      retired=[v for v in earlier if v not in kept], keep_versions=options.keep_versions)
    pointer_bytes = pointer.model_dump_json().encode()
    try:
        for sha, data in writes.items():
            put(store, segment_key(name, sha), data)
        put(store, version_key(name, version), record_bytes)
        lock.confirm()
        put(store, pointer_key(name), pointer_bytes)  # the commit
    except Exception:
        if get(store, pointer_key(name)) != pointer_bytes:  # not committed after all
            _forget_writes(store, name, base)
        raise
    if committed is not None:
        committed(pointer_bytes, pointer, record)
    store.register_index(published_location(name))  # its chunks' states are kept by prune
    retry = [] if base is None else base.retired  # should the publish before have stopped while removing them
    remove_versions(store, name, [*pointer.retired, *retry], listed | _listed(store, name, kept, held))
    delete(store, [pending_key(name)])
    if cache is not None:
        for sha, data in writes.items():
            cache.put(sha, data)
        cache.keep(listed)
    return pointer_bytes, pointer, record


def chunk_runs(chunks: Sequence[Document], dimension: int, segment_bytes: int) -> list[tuple[int, int]]:
    """Runs [a, b) of `chunks`, in order, each of encoded size at most about `segment_bytes` (one chunk at least)."""
    runs, start, size = [], 0, 0
    for i, chunk in enumerate(chunks):
        nbytes = len(chunk.page_content.encode()) + len(json.dumps(chunk.metadata, default=str)) + 4 * dimension + 80
        if i > start and size + nbytes > segment_bytes:
            runs.append((start, i))
            start, size = i, 0
        size += nbytes
    if start < len(chunks):
        runs.append((start, len(chunks)))
    return runs


def merge_groups(refs: Sequence[SegmentRef], options: PublishOptions, compact: bool) -> list[list[int]]:
    """The segments (by position) as groups of adjacent ones to merge into one: singletons unless more than
    `max_small_segments` are small, or `compact`; then each run of mergeable ones, greedily, up to `segment_bytes`."""
    limit = options.segment_bytes
    small = [ref.nbytes < limit // 4 for ref in refs]
    if not compact and sum(small) <= options.max_small_segments:
        return [[i] for i in range(len(refs))]
    mergeable = [True] * len(refs) if compact else small
    groups: list[list[int]] = []
    size = 0
    for i, ref in enumerate(refs):
        if groups and mergeable[i] and mergeable[groups[-1][-1]] and size + ref.nbytes <= limit:
            groups[-1].append(i)
            size += ref.nbytes
        else:
            groups.append([i])
            size = ref.nbytes
    return groups


def remove_versions(store: NuggetStore, name: str, versions: Sequence[int], keep: set[str]) -> None:
    """Remove the records of `versions` and their segments but those in `keep` (listed by a kept version)."""
    for version in dict.fromkeys(versions):
        key = version_key(name, version)
        data = get(store, key)
        if data is None:
            continue
        try:
            listed = {ref.sha256 for ref in VersionRecord.model_validate_json(data).segments}
        except ValueError:  # a malformed record: its segments are left
            listed = set()
        delete(store, [segment_key(name, sha) for sha in sorted(listed - keep)])
        delete(store, [key])


def _listed(store: NuggetStore, name: str, versions: Sequence[int], held: VersionRecord | None = None) -> set[str]:
    """The segments the records of `versions` list (those still in the store; `held`, of its version, not read)."""
    listed: set[str] = set()
    for version in versions:
        if held is not None and version == held.version:
            listed |= {ref.sha256 for ref in held.segments}
            continue
        try:
            listed |= {ref.sha256 for ref in read_record(store, name, version).segments}
        except LookupError:
            continue
    return listed


def _forget_writes(store: NuggetStore, name: str, base: Pointer | None) -> None:
    """After a publish failed before its commit: remove the segments it wrote (but those a kept version lists), and
    its pending record, where the store lets; what stays is removed by the next publish."""
    try:
        _remove_pending(store, name, base)
        delete(store, [pending_key(name)])
    except Exception as err:  # the store refuses deletes too: the pending record names them for the next publish
        log.warning("the segments of a failed publish of %r stay in %s until the next publish: %s", name,
                    describe(store), err)


def _remove_pending(store: NuggetStore, name: str, base: Pointer | None, held: VersionRecord | None = None) -> None:
    """Remove the segments a publish that stopped before its commit wrote, but those the current version (`base`;
    `held`, its record where this process holds it) or a kept one lists; all of them while a record of those does
    not parse (its segments are not known: the repair's to sort out)."""
    data = get(store, pending_key(name))
    if data is None:
        return
    try:
        pending = [str(sha) for sha in json.loads(data)]
    except (ValueError, TypeError):
        pending = []
    try:
        keep = set() if base is None else _listed(store, name, [*base.kept, base.version], held)
    except IndexFileError:
        return
    delete(store, [segment_key(name, sha) for sha in pending if sha not in keep])


def published_texts(store: NuggetStore, name: str) -> tuple[set[str], set[str]]:
    """The texts of the chunks of every kept version of the index `name` in `store`, and the nugget fingerprints
    they were published with (what prune keeps)."""
    found = read_pointer(store, name)
    if found is None:
        return set(), set()
    pointer = found[1]
    texts, fingerprints = set(), set()
    for version in [*pointer.kept, pointer.version]:
        try:
            record, chunks, _ = read_version(store, name, version,
                                             pointer.sha256 if version == pointer.version else None)
        except VersionRemovedError:
            continue
        texts |= {d.page_content for d in chunks}
        fingerprints.add(str(record.manifest.get("nugget_fingerprint")))
    return texts, fingerprints


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


__all__: list[str] = [
    "PublishOptions", "chunk_runs", "commit_version", "merge_groups", "publish_version", "published_texts",
    "remove_versions",
]

"""`nugget-rag index check`: the published index's fsck (the layout: segments.py), and its repair.

    report = check_index(store, "default")            # every version the pointer names: record, segments, counts
    report = repair_index(store, "default", caches)   # rewrite what a verified copy has; publish without the rest

The check reads the pointer, then each version it names (the current one and those kept for readers): its record
(against the pointer's sha256, counts, dimension), every segment it lists (present, its sha256, its chunks and
vectors), chunk ids once, and the nugget states the current version's chunks name (a missing state is only a
warning: it is compressed again when first read). It changes nothing.

The repair takes the publish lock, then writes each missing or altered segment again from a verified copy: a local
segment cache, or the same chunks held intact by another version's segments. Where no copy is left, it publishes a
consistent version without the lost segments (their chunks' sources, which the record lists, are named so that they
can be ingested again) and retires the broken versions. A current record that is not the one its pointer names
(altered) but still parses is rebuilt from its segments that verify (each is named by its sha256, so the chunks are
the ones published); a record that does not parse is replaced by the newest intact one, the sources of the chunks
only it held named from whatever of it still reads as JSON. The repair keeps the index's own `keep_versions` (its
pointer's). Nothing here runs code read from the store.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from langchain_core.documents import Document
from pydantic import BaseModel

from nugget_rag.components.compressor import METADATA_KEY
from nugget_rag.state.store import NuggetStore

from ..local.files import IndexFileError
from .lock import publish_lock
from .publishing import PublishOptions, commit_version
from .segments import (
    PREFIX,
    Pointer,
    SegmentCache,
    SegmentRef,
    VersionRecord,
    check_name,
    decode_segment,
    describe,
    encode_segment,
    get,
    intact,
    put,
    read_pointer,
    read_record,
    redis_key,
    segment_key,
    version_key,
)

log = logging.getLogger(__name__)


class IndexReport(BaseModel):
    """What a check found (`problems`: what is broken; `warnings`: what is not), and what a repair did."""

    name: str
    store: str
    version: int = 0
    versions: list[int] = []
    chunks: int = 0
    segments: int = 0
    problems: list[str] = []
    warnings: list[str] = []
    actions: list[str] = []
    lost_sources: list[str] = []

    @property
    def ok(self) -> bool:
        """Nothing is broken (chunks may have been lost: `lost_sources`)."""
        return not self.problems

    def text(self) -> str:
        """The report for a terminal: one line a finding or action, then the verdict."""
        lines = [f"the index {self.name!r} in {self.store}: version {self.version}, {self.chunks} chunks in "
                 f"{self.segments} segments; versions checked: {', '.join(map(str, self.versions)) or 'none'}"]
        lines += [f"  repaired: {a}" for a in self.actions] + [f"  warning: {w}" for w in self.warnings]
        lines += [f"  BROKEN: {p}" for p in self.problems]
        if self.lost_sources:
            lines.append("  chunks lost with no copy left; ingest these sources again:")
            lines += [f"    {source}" for source in self.lost_sources]
        if not self.ok:
            lines.append(f"{len(self.problems)} problems remain; run `nugget-rag index check --store '{self.store}' "
                         f"--name {self.name} --repair`")
        else:
            lines.append("consistent again, without the chunks above" if self.lost_sources else "ok")
        return "\n".join(lines)


class _Scan:
    """One pass over the versions the pointer names: each record, and each segment read once and checked."""

    def __init__(self, store: NuggetStore, name: str):
        self.store, self.name = store, name
        self.report = IndexReport(name=name, store=describe(store))
        self.records: dict[int, VersionRecord] = {}
        self.broken: dict[int, list[str]] = {}  # version -> what is wrong with it
        self.bad: dict[str, str] = {}  # segment sha256 -> "missing" or "altered"
        self.decoded: dict[str, tuple[list[Document], np.ndarray]] = {}  # intact segments by sha256
        self.unverified: dict[int, VersionRecord] = {}  # records that parse but are not the ones their pointer names
        self.named: dict[int, list[str]] = {}  # sources a record that does not parse still names
        found = read_pointer(store, check_name(name))
        if found is None:
            named = sorted(i.split("/", 1)[1] for i in store.indexes() if i.startswith(f"{PREFIX}/"))
            raise ValueError(f"no index named {name!r} is published in the nugget store {describe(store)} (published "
                             f"there: {', '.join(named) or 'none'}); give --name NAME of one of them, or publish it "
                             "first (`nugget-rag ingest PATH... --store URL`)")
        self.pointer = found[1]
        for version in [*self.pointer.kept, self.pointer.version]:
            self._check_version(version, self.pointer.sha256 if version == self.pointer.version else None)
        self.report.versions = [*self.pointer.kept, self.pointer.version]
        self.report.problems = [p for v in sorted(self.broken) for p in self.broken[v]]
        self._check_states()

    def _check_version(self, version: int, sha256: str | None) -> None:
        try:
            record = read_record(self.store, self.name, version, sha256)
        except LookupError as err:
            self.broken[version] = [f"version {version}: {getattr(err, 'damage', err)}"]
            return
        except IndexFileError as err:
            self.broken[version] = [f"version {version}: {err}"]
            self._read_damaged(version)
            return
        self.records[version] = record
        ids: set[str] = set()
        for ref in record.segments:
            if ref.sha256 not in self.decoded and ref.sha256 not in self.bad:
                self._check_segment(ref, record)
            if ref.sha256 in self.bad:
                self.broken.setdefault(version, []).append(self._segment_problem(version, ref))
            else:
                ids |= {d.id for d in self.decoded[ref.sha256][0]}
        if version not in self.broken and len(ids) != record.count:
            self.broken[version] = [f"version {version}: {record.count} chunks listed, {len(ids)} distinct ids"]
        if version == self.pointer.version:
            self.report.version, self.report.chunks, self.report.segments = version, record.count, len(record.segments)

    def _segment_problem(self, version: int, ref: SegmentRef) -> str:
        sources = f" ({ref.count} chunks from {', '.join(ref.sources[:3])}{', ...' if len(ref.sources) > 3 else ''})" \
            if ref.sources else f" ({ref.count} chunks)"
        return f"version {version}: {segment_key(self.name, ref.sha256)} is {self.bad[ref.sha256]}{sources}"

    def _read_damaged(self, version: int) -> None:
        """Read the record of `version`, which failed its checks, as far as it goes: a VersionRecord of this name
        and version (its segments checked, and what a repair can do said), else the sources its JSON names."""
        data = get(self.store, version_key(self.name, version))
        try:
            record = VersionRecord.model_validate_json(data or b"")
        except ValueError:
            record = None
        if record is None or (record.name, record.version) != (self.name, version):
            self.named[version] = named_sources(data)
            return
        self.unverified[version] = record
        for ref in record.segments:
            if ref.sha256 not in self.decoded and ref.sha256 not in self.bad:
                self._check_segment(ref, record)
        whole = sum(ref.sha256 in self.decoded for ref in record.segments)
        self.broken[version][0] += (f" (it still parses, and {whole} of its {len(record.segments)} segments verify: "
                                    "--repair rebuilds it from them)")
        self.broken[version] += [self._segment_problem(version, ref) for ref in record.segments
                                 if ref.sha256 in self.bad]
        if version == self.pointer.version:
            self.report.version, self.report.chunks, self.report.segments = version, record.count, len(record.segments)

    def _check_segment(self, ref: SegmentRef, record: VersionRecord) -> None:
        key = segment_key(self.name, ref.sha256)
        data = get(self.store, key)
        if not intact(data, ref):
            self.bad[ref.sha256] = "missing" if data is None else "altered (its sha256 is not the one it is named by)"
            return
        try:
            self.decoded[ref.sha256] = decode_segment(data, ref, record.dimension, key)
        except IndexFileError as err:
            self.bad[ref.sha256] = f"malformed ({err})"

    def _check_states(self) -> None:
        """Warn of the current version's chunks whose nugget state is not in the store."""
        record = self.records.get(self.pointer.version)
        if record is None:
            return
        keys = [str(d.metadata.get(METADATA_KEY, {}).get("key")) for ref in record.segments
                if ref.sha256 in self.decoded for d in self.decoded[ref.sha256][0]]
        missing = [k for k, here in zip(keys, present(self.store, keys)) if not here]
        if missing:
            self.report.warnings.append(f"{len(missing)} of {len(keys)} chunks name a nugget state the store lacks "
                                        f"(e.g. {missing[0]}): each is compressed again when first read")

    def copy_of(self, ref: SegmentRef, version: int, caches: Sequence[SegmentCache]) -> tuple[bytes, str] | None:
        """A verified copy of the segment `ref` of `version`, and where it came from: a cache, or the same chunks at
        the same positions in another version's intact segments (publishes append, so positions hold)."""
        for cache in caches:
            if (data := cache.get(ref.sha256)) is not None:
                return data, f"the segment cache {cache.directory}"
        record = self.records.get(version) or self.unverified[version]
        start = sum(r.count for r in record.segments[:record.segments.index(ref)])
        for other, held in self.records.items():
            chunks, vectors = self.held(held)
            if other != version and len(chunks) >= start + ref.count and all(
                    c is not None for c in chunks[start:start + ref.count]):
                data = encode_segment(chunks[start:start + ref.count], np.stack(vectors[start:start + ref.count]))
                if intact(data, ref):
                    return data, f"the chunks of version {other}"
        return None

    def held(self, record: VersionRecord) -> tuple[list[Document | None], list[np.ndarray | None]]:
        """The chunks and vectors of `record` by position (None where its segment is not intact)."""
        chunks: list[Document | None] = []
        vectors: list[np.ndarray | None] = []
        for ref in record.segments:
            found = self.decoded.get(ref.sha256)
            chunks += found[0] if found else [None] * ref.count
            vectors += list(found[1]) if found else [None] * ref.count
        return chunks, vectors


def named_sources(data: bytes | None) -> list[str]:
    """The sources a record that does not parse as a VersionRecord still names, where it reads as JSON (else none)."""
    try:
        refs = json.loads(data or b"")["segments"]
        return list(dict.fromkeys(str(source) for ref in refs for source in ref.get("sources", [])))
    except (TypeError, ValueError, KeyError, AttributeError):
        return []


def present(store: NuggetStore, keys: Sequence[str]) -> list[bool]:
    """Whether each of `keys` is in the store's ByteStore (Redis: EXISTS, without reading the values)."""
    client = store.redis_client
    if client is not None:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(redis_key(store, key))
        return [bool(n) for n in pipe.execute()]
    return [store.byte_store.mget([key])[0] is not None for key in keys]


def check_index(store: NuggetStore, name: str = "default") -> IndexReport:
    """Check every version of the index `name` published in `store` that its pointer names; changes nothing. A
    ValueError naming the indexes published there when `name` is not one."""
    return _Scan(store, name).report


def repair_index(store: NuggetStore, name: str = "default", caches: Sequence[Path] = (),
                 wait_s: float | None = None) -> IndexReport:
    """Check, then repair under the publish lock (waiting at most `wait_s`, PublishLockBusy beyond): rewrite each
    missing or altered segment from a verified copy (the segment `caches` given, another version's chunks); where
    none is left, publish a version without the lost chunks, naming their sources. Returns the check after it,
    with what was done."""
    caches = [SegmentCache(path) for path in caches if Path(path).is_dir()]
    actions: list[str] = []
    with publish_lock(store, check_name(name), wait_s) as lock:
        scan = _Scan(store, name)
        for version, record in sorted({**scan.unverified, **scan.records}.items()):
            for ref in record.segments:
                if ref.sha256 in scan.bad and (copy := scan.copy_of(ref, version, caches)) is not None:
                    put(store, segment_key(name, ref.sha256), copy[0])
                    actions.append(f"wrote {segment_key(name, ref.sha256)} again from {copy[1]}")
                    log.warning("repaired %s in %s from %s", segment_key(name, ref.sha256), describe(store), copy[1])
        if actions:
            scan = _Scan(store, name)
        lost: list[str] = []
        if scan.broken:
            lost, action = _publish_consistent(store, name, scan, lock)
            actions.append(action)
            scan = _Scan(store, name)
    scan.report.actions, scan.report.lost_sources = actions, lost
    return scan.report


def keep_versions(pointer: Pointer) -> int:
    """The versions the index keeps (PublishOptions.keep_versions), as its pointer records them (a pointer written
    before it recorded them: those it keeps, and the current one)."""
    return pointer.keep_versions or len(pointer.kept) + 1


def _publish_consistent(store: NuggetStore, name: str, scan: _Scan, lock: Any) -> tuple[list[str], str]:
    """Publish the current version's intact segments as a new version (its record rebuilt where it parses but is
    altered; else the newest intact record's), retiring every broken one; the lost chunks' sources, and what was
    done."""
    pointer, intact_versions = scan.pointer, [v for v in scan.records if v not in scan.broken]
    base = scan.records.get(pointer.version) or scan.unverified.get(pointer.version) or (
        scan.records[max(intact_versions)] if intact_versions else None)
    if base is None:
        raise IndexFileError(f"no version of the index {name!r} in {describe(store)} has a record left: nothing to "
                             "publish from; ingest its documents again under a new name (or delete its keys)")
    kept = [ref for ref in base.segments if ref.sha256 not in scan.bad]
    lost = [ref for ref in base.segments if ref.sha256 in scan.bad]
    count = sum(ref.count for ref in kept)
    manifest = {**base.manifest, "count": count}
    record = VersionRecord(name=name, version=pointer.version + 1, count=count, dimension=base.dimension,
                           manifest=manifest, segments=kept)
    options = PublishOptions(name=name, keep_versions=keep_versions(pointer))
    commit_version(store, options, pointer, record, {}, lock, broken=list(scan.broken))
    sources = list(dict.fromkeys(s for ref in lost for s in ref.sources))
    unnamed = sum(ref.count for ref in lost if not ref.sources)
    if unnamed:
        sources.append(f"({unnamed} chunks whose sources an earlier version's record did not list)")
    if base.version != pointer.version:
        held = {s for ref in base.segments for s in ref.sources}
        named = [s for s in scan.named.get(pointer.version, []) if s not in held]
        sources += named or [f"(whatever was ingested after version {base.version}: version {pointer.version}'s "
                             "record is lost)"]
    dropped = f"without {sum(ref.count for ref in lost)} lost chunks" if lost else "from the last intact record"
    if pointer.version in scan.unverified:
        dropped = (f"from version {pointer.version}'s altered record, rebuilt from its {len(kept)} segments that "
                   f"verify{f' (without {sum(ref.count for ref in lost)} lost chunks)' if lost else ''}")
    log.warning("published version %d of %r in %s %s, retiring versions %s", record.version, name, describe(store),
                dropped, json.dumps(sorted(scan.broken)))
    return sources, (f"published version {record.version} ({count} chunks) {dropped}, retiring the broken versions "
                     f"{', '.join(map(str, sorted(scan.broken)))}")


__all__: list[str] = ["IndexReport", "check_index", "present", "repair_index"]

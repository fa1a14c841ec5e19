"""What a publish checks before it commits (publishing.py): that every segment the new version lists, and that
an earlier publish wrote, is in the store and intact, written again from a verified copy where it is not; and that no
segment is larger than the store takes. A damaged store never becomes the next version."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from nugget_rag.state.store import NuggetStore

from .segments import (
    DamagedIndexError,
    Pointer,
    SegmentCache,
    SegmentRef,
    VersionRecord,
    damaged,
    describe,
    get,
    intact,
    segment_key,
)

log = logging.getLogger(__name__)


def verify_listed(store: NuggetStore, name: str, base: tuple[Pointer, VersionRecord] | None, refs: Sequence[SegmentRef],
                  copies: dict[str, Callable[[], bytes]], cache: SegmentCache | None) -> dict[str, bytes]:
    """The segments of `refs` (written before, listed again by the version being published) that the store lacks or
    holds altered, each from a verified copy: `copies` (by sha256: encoded again from the chunks this process holds)
    or `cache`; each is logged. One with no verified copy refuses the publish (DamagedIndexError naming it)."""
    rewrites: dict[str, bytes] = {}
    for ref in refs:
        key = segment_key(name, ref.sha256)
        data = get(store, key)
        if intact(data, ref):
            continue
        kind = "missing" if data is None else "altered"
        found = {"the version this process holds": copies.get(ref.sha256),
                 "this machine's cache": None if cache is None else (lambda sha=ref.sha256: cache.get(sha))}
        for source, copy in found.items():
            if copy is not None and intact(data := copy(), ref):
                log.warning("%s in the nugget store %s was %s: written again from %s", key, describe(store), kind,
                            source)
                rewrites[ref.sha256] = data
                break
        else:
            version = 0 if base is None else base[0].version
            damage = damaged(store, name, version, key, kind)
            raise DamagedIndexError(f"{damage}. This process holds no verified copy of it, so nothing was published: "
                                    f"version {version} stays current", kind, key, version)
    return rewrites


def check_sizes(store: NuggetStore, segment_bytes: int, record: VersionRecord, writes: dict[str, bytes]) -> None:
    """A ValueError naming a segment larger than the store takes (a Redis's proto-max-bulk-len), before any write."""
    limit = value_limit(store)
    for sha, data in writes.items():
        if limit is not None and len(data) > limit:
            ref = next(r for r in record.segments if r.sha256 == sha)
            raise ValueError(f"segment {segment_key(record.name, sha)} ({ref.count} chunks from "
                             f"{', '.join(ref.sources[:3]) or 'unnamed sources'}) is {len(data):,} bytes, more than "
                             f"the nugget store {describe(store)} takes in one value ({limit:,} bytes, its "
                             f"proto-max-bulk-len): publish with a smaller PublishOptions(segment_bytes=...) (now "
                             f"{segment_bytes:,}), or raise the store's limit; a single chunk that large needs "
                             "smaller chunks or less metadata. Nothing was published")


def value_limit(store: NuggetStore) -> int | None:
    """The most bytes one value of the store may hold: a Redis server's proto-max-bulk-len; None: no known limit."""
    client = store.redis_client
    if client is None:
        return None
    try:
        return int(client.config_get("proto-max-bulk-len")["proto-max-bulk-len"])
    except Exception:  # CONFIG refused (a managed Redis): Redis's default
        return 512 * 2**20


__all__: list[str] = ["check_sizes", "value_limit", "verify_listed"]

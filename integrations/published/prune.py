"""Prune a nugget store: remove the states no index references.

Nuggets are a content-addressed cache that chunks (and indexes) share, so `NuggetIndex.delete` leaves them. An
index's own store (`DIR/nuggets`) is its alone; every index saved over a shared store (Redis) is registered in it
(`NuggetStore.register_index`, "HOST:PATH"), as is every index published in the store itself
("published-index/NAME", index.py: the chunks of each version it keeps). A prune keeps every state
of a chunk of the indexes given or registered, whatever model or floor made it, and removes the rest.

It reads each index's saved chunks (its docstore, never its vectors), holding the lock of every index directory,
so that no `ingest` into them runs meanwhile. It refuses, removing nothing, when a registered index is another
host's: prune where every index over the store can be read. An index registered on this host whose directory
holds no index any more was deleted: it is forgotten. An index is registered when it is saved: the states an
ingest into a new index stores before its first save may be removed by a prune meanwhile (they are computed again
when read).
"""

from __future__ import annotations

import socket
from contextlib import ExitStack
from pathlib import Path

from filelock import FileLock
from pydantic import BaseModel

from nugget_rag.state.store import NuggetStore

from ..local.files import LOCK_FILE, MANIFEST_FILE, index_location, read_manifest, read_records
from .lock import publish_lock
from .publishing import published_texts
from .segments import PREFIX, read_pointer


class PruneReport(BaseModel):
    """What a prune did: the indexes whose chunks it kept, those it forgot (deleted), and the states kept and removed."""

    indexes: list[str]
    forgotten: list[str]
    kept: int
    removed: int
    bytes_removed: int


def prune(directories: list[str | Path], store: NuggetStore) -> PruneReport:
    """Remove the states in `store` that no index references: neither the indexes in `directories` nor any other
    registered over the store (a ValueError names one that cannot be read here, before anything is removed)."""
    given = [index_location(d) for d in directories]
    host = socket.gethostname()
    with ExitStack() as locks:
        locations, forgotten, texts, fingerprints = sorted(set(store.indexes()) | set(given)), [], set(), set()
        paths: dict[str, Path] = {}
        for location in locations:
            if location.startswith(f"{PREFIX}/"):  # an index published in the store itself
                name = location.removeprefix(f"{PREFIX}/")
                locks.enter_context(publish_lock(store, name))  # no publish meanwhile
                published, published_fingerprints = published_texts(store, name)
                texts.update(published)
                fingerprints.update(published_fingerprints)
                if not published and read_pointer(store, name) is None:
                    forgotten.append(location)
                continue
            where, _, path = location.partition(":")
            if where != host:
                raise ValueError(f"the nugget store is also used by the index at {location}, which cannot be read on "
                                 f"this host ({host}); nothing was removed. Prune on a host that reads every index "
                                 "over the store")
            paths[location] = Path(path)
        for location, path in paths.items():
            if not (path / MANIFEST_FILE).is_file():
                if location in given:
                    raise ValueError(f"no index in {path}: run `nugget-rag ingest PATH... --index {path}` first")
                forgotten.append(location)
                continue
            locks.enter_context(FileLock(path / LOCK_FILE))  # no ingest into it meanwhile
            manifest = read_manifest(path)
            fingerprints.add(manifest.get("nugget_fingerprint"))
            if manifest.get("count"):
                docs, _ = read_records(path, manifest)
                texts.update(d.page_content for d in docs.values())
        counts = store.prune(texts, {f for f in fingerprints if isinstance(f, str)})  # their states: by key alone
    for location in forgotten:
        store.forget_index(location)
    return PruneReport(indexes=[loc for loc in locations if loc not in forgotten], forgotten=forgotten, **counts)


__all__ = ["PruneReport", "prune"]

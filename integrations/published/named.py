"""The index a setting names (a command's --index, a replica's index_dir): the one saved in a directory, else (None)
the one published in a store; where it is, in words, and its manifest, read one way for the command and Ray Serve."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nugget_rag.state.store import NuggetStore

from ..local.files import read_manifest
from .index import published_manifest


@dataclass(frozen=True)
class NamedIndex:
    """The index saved in `directory`, or (None) the one published in `store`."""

    directory: str | Path | None
    store: NuggetStore | None = None

    @property
    def where(self) -> str:
        """The index in words, as a refusal names it."""
        if self.directory is not None:
            return f"the index in {self.directory}"
        return f"the index published in {self.store.location}"

    def manifest(self) -> dict[str, Any] | None:
        """Its manifest (nugget model, ratio, embeddings, count); None where none is saved or published yet."""
        return read_manifest(self.directory) if self.directory is not None else published_manifest(self.store)


__all__ = ["NamedIndex"]

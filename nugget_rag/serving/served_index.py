"""The index a server answers over (`ServedIndex`): the version a question reads, and how documents are added.

Implemented by the index a process keeps (local_index.py: in memory, or saved in a directory), by the index other
processes publish, and by a Ray Serve replica's index (ray_serve.py). Each version `current()`
returns is read whole: an ingest builds the next version beside it and publishes it once it is complete.
"""

from __future__ import annotations

from typing import Protocol

from langchain_core.documents import Document

from ..cancellation import Stop
from ..components.compressor import NuggetCompressor
from ..integrations.local.index import NuggetIndex


class ServedIndex(Protocol):
    """An index served to questions while documents are added to it."""

    compressor: NuggetCompressor  # its model and nugget store
    location: str | None  # where it lives, recorded with its ingest jobs for a server over it to resume (None: memory)

    def current(self) -> NuggetIndex:
        """The whole index version a question reads now; no ingest changes it afterwards."""
        ...

    def ingest(self, documents: list[Document], stop: Stop) -> int:
        """Add `documents` (new chunks only) and publish the result; returns the number of new chunks. Once `stop()`
        is true it stops at its next step with RequestCancelled, publishing nothing."""
        ...

    def __len__(self) -> int:
        """The chunks in the current version."""
        ...


__all__ = ["ServedIndex"]

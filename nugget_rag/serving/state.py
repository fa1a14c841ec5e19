"""The server's settings and its state: one object that every route reaches through the `State` dependency."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from ..components.compressor import NuggetCompressor
from ..generation.batching import BatchedGenerator
from .admission import Slots
from .ingest_jobs import IngestJobs
from .job_records import JobRecords
from .middleware import Metrics
from .served_index import ServedIndex


class ServerSettings(BaseModel):
    """What `create_app` takes beside the index (`nugget-rag serve`'s options)."""

    model_config = ConfigDict(extra="forbid")

    max_pending: int = Field(32, ge=1, description="requests in flight at most; more get 503")
    max_body_bytes: int = Field(1 << 20, ge=1, description="a larger request body gets 413")
    max_batch: int = Field(8, ge=1, description="answers decoded together in one batch")
    request_timeout_s: float = Field(600, gt=0, description="a request still under way after this long stops at its "
                                     "next step (504)")
    api_key: str | None = Field(None, description="the key every path but /health needs (None: none)")
    max_ingest_documents: int = Field(100, ge=1, description="the most documents one /ingest or /compress request "
                                      "takes (more: 413; POST /ingest/jobs takes more, in the background)")
    resume_jobs: bool = Field(False, description="as it starts, the server resumes the ingest jobs into its index "
                              "whose server stopped (IngestJobs.resume_stale)")


@dataclass
class AppState:
    """The served index and everything the routes share: answers' batches, admission, metrics, ingest jobs."""

    served: ServedIndex
    settings: ServerSettings
    batcher: BatchedGenerator
    slots: Slots
    metrics: Metrics
    jobs: IngestJobs
    # searches take turns: the embeddings and the vector store need not be thread-safe
    search: threading.Lock = field(default_factory=threading.Lock)
    started: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(cls, served: ServedIndex, settings: ServerSettings) -> AppState:
        """The state of a new server over `served`; its jobs ingest through `served.ingest`."""
        jobs = IngestJobs(served.ingest, JobRecords(served.compressor.store), index=served.location,
                          busy=lambda: slots.count > 0)  # questions first: a job waits between batches
        metrics = Metrics(pending=lambda: slots.count, jobs=lambda: jobs.active)
        slots = Slots(settings.max_pending, settings.request_timeout_s, metrics)
        batcher = BatchedGenerator(served.compressor.model, max_batch=settings.max_batch)
        return cls(served, settings, batcher, slots, metrics, jobs)

    @property
    def compressor(self) -> NuggetCompressor:
        return self.served.compressor

    @property
    def model_name(self) -> str:
        return self.compressor.model.base_name


def app_state(request: Request) -> AppState:
    """The state of the app that `request` reached."""
    return request.app.state.nugget


State = Annotated[AppState, Depends(app_state)]

__all__ = ["AppState", "ServerSettings", "State", "app_state"]

"""Background ingest jobs (POST /ingest/jobs of `nugget-rag serve`), their records kept with the nugget store.

A server runs its jobs one at a time in a worker thread, JOB_PART documents a step, and writes each job's record
(JSON) where every server over the same store reads it: a file each in a directory store's `jobs/` folder, a field
each of a Redis store's hash `<namespace>:ingest-jobs`, or, for a store with neither, the server's memory. So a
restarted server, or another one over the same store, lists the jobs and reports their status.

A job's documents live only in the memory of the server that runs it. That server refreshes its jobs' `heartbeat`
every HEARTBEAT_S; a job still queued or running whose server stopped (shut down, or silent for STALE_S) is reported
"interrupted", with what it had ingested: send the rest again (states already stored are not computed again).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Literal

from langchain_core.documents import Document
from pydantic import BaseModel, Field, ValidationError

from ..cancellation import Stop
from ..files import write_atomic
from ..store import NuggetStore

log = logging.getLogger(__name__)

JOB_PART = 32  # documents an ingest job adds, and publishes, per step
MAX_JOBS = 16  # ingest jobs queued or running at once on one server
KEPT_JOBS = 100  # finished jobs whose records stay readable
JOB_NICE = 10  # how much nicer than the server the thread that runs ingest jobs is (Linux)
HEARTBEAT_S = 10.0  # how often a server refreshes the records of its jobs under way
STALE_S = 3 * HEARTBEAT_S  # a job under way whose record is older than this: its server stopped
CLOSE_WAIT_S = 60.0  # how long a stopping server waits for the step its job has under way
JOBS_FOLDER = "jobs"  # in a directory store
_JOB_ID = re.compile(r"ingest-[0-9a-f]{32}")


class IngestJobError(Exception):
    """A request about ingest jobs that cannot be met (the server maps each kind to its HTTP status)."""


class JobNotFound(IngestJobError, LookupError):
    """No job has this id (or its record was dropped)."""


class JobConflict(IngestJobError):
    """The job cannot be changed here: another server runs it."""


class JobsUnavailable(IngestJobError):
    """This server takes no more jobs now: it is shutting down, or MAX_JOBS are under way."""


class IngestJob(BaseModel):
    """A background ingest (POST /ingest/jobs) and its progress."""

    id: str
    status: Literal["queued", "running", "done", "failed", "cancelled", "interrupted"] = "queued"
    documents: int
    done: int = Field(0, description="Documents ingested so far: questions read their chunks.")
    added: int = Field(0, description="New chunks so far.")
    error: str | None = None
    created: float = Field(default_factory=time.time)
    finished: float | None = None
    server: str = Field("", description="The server that runs it: host:process id.")
    heartbeat: float | None = Field(None, description="When its server last said it was under way.")

    @property
    def active(self) -> bool:
        return self.status in ("queued", "running")

    def interrupted(self, why: str, at: float) -> IngestJob:
        """This job, reported as stopped with its server at `at`: what it had ingested stays."""
        return self.model_copy(update={
            "status": "interrupted", "finished": at,
            "error": f"{why} before the job ended: {self.done} of {self.documents} documents were ingested ("
                     f"{self.added} new chunks); send the rest again"})


class JobRecords:
    """IngestJob records as JSON beside `store`'s nugget states: files in a directory store's `jobs/` folder, fields
    of the hash `<namespace>:ingest-jobs` in a Redis store, or memory for a store with neither."""

    def __init__(self, store: NuggetStore):
        location = store.location
        self._redis = store.redis_client
        self._hash = f"{location.namespace}:ingest-jobs" if self._redis is not None else ""
        directory = location.directory if location is not None else None
        self._folder = directory / JOBS_FOLDER if directory is not None else None
        self._memory: dict[str, str] = {}  # where there is neither

    def put(self, job: IngestJob) -> None:
        data = job.model_dump_json()
        if self._redis is not None:
            self._redis.hset(self._hash, job.id, data)
        elif self._folder is not None:
            self._folder.mkdir(exist_ok=True)
            write_atomic(self._folder / f"{job.id}.json", data)
        else:
            self._memory[job.id] = data

    def get(self, job_id: str) -> IngestJob | None:
        if not _JOB_ID.fullmatch(job_id):
            return None
        if self._redis is not None:
            data = self._redis.hget(self._hash, job_id)
        elif self._folder is not None:
            try:
                data = (self._folder / f"{job_id}.json").read_bytes()
            except FileNotFoundError:
                data = None
        else:
            data = self._memory.get(job_id)
        return None if data is None else self._parse(job_id, data)

    def all(self) -> list[IngestJob]:
        """Every job recorded, oldest first."""
        if self._redis is not None:
            found = {key.decode(): data for key, data in self._redis.hgetall(self._hash).items()}
        elif self._folder is not None:
            found = {}
            for path in self._folder.glob("ingest-*.json"):
                try:
                    found[path.stem] = path.read_bytes()
                except FileNotFoundError:  # deleted meanwhile (another server keeps KEPT_JOBS too)
                    continue
        else:
            found = dict(self._memory)
        jobs = [self._parse(job_id, data) for job_id, data in found.items()]
        return sorted((job for job in jobs if job is not None), key=lambda job: job.created)

    def delete(self, ids: list[str]) -> None:
        if not ids:
            return
        if self._redis is not None:
            self._redis.hdel(self._hash, *ids)
        elif self._folder is not None:
            for job_id in ids:
                (self._folder / f"{job_id}.json").unlink(missing_ok=True)
        else:
            for job_id in ids:
                self._memory.pop(job_id, None)

    @staticmethod
    def _parse(job_id: str, data: bytes | str) -> IngestJob | None:
        try:
            return IngestJob.model_validate_json(data)
        except ValidationError as err:
            log.warning("the record of ingest job %s is malformed and was ignored: %s", job_id, err)
            return None


class IngestJobs:
    """This server's ingest jobs, run one at a time by a worker thread (started with the first) through
    `ingest(documents, stop)`, which stops at its next step once `stop()` is true; every change is written to
    `records`, which also hold the jobs of other servers over the same store."""

    def __init__(self, ingest: Callable[[list[Document], Stop], int], records: JobRecords):
        self.ingest, self.records = ingest, records
        self.server = f"{socket.gethostname()}:{os.getpid()}"
        self.running: dict[str, IngestJob] = {}  # this server's jobs queued or running
        self.lock = threading.Lock()  # held to change a job and write its record
        self.todo: queue.Queue[tuple[IngestJob, list[Document]] | None] = queue.Queue()  # None: the worker ends
        self.closed = threading.Event()
        self.threads: list[threading.Thread] = []  # the worker and the heartbeat, started with the first job

    @property
    def active(self) -> int:
        with self.lock:
            return len(self.running)

    def submit(self, documents: list[Document]) -> IngestJob:
        with self.lock:
            if self.closed.is_set():
                raise JobsUnavailable("the server is shutting down; submit the job to another one")
            if len(self.running) >= MAX_JOBS:
                raise JobsUnavailable(f"{MAX_JOBS} ingest jobs are queued or running; retry once one is done")
            job = IngestJob(id=f"ingest-{uuid.uuid4().hex}", documents=len(documents), server=self.server,
                            heartbeat=time.time())
            self.records.put(job)
            self.running[job.id] = job
            finished = [j.id for j in self._reported(self.records.all()) if not j.active]
            self.records.delete(finished[:max(0, len(finished) - KEPT_JOBS)])
            if not self.threads:
                self.threads = [threading.Thread(target=self._work, name="ingest-jobs", daemon=True),
                                threading.Thread(target=self._beat, name="ingest-jobs-heartbeat", daemon=True)]
                for thread in self.threads:
                    thread.start()
            self.todo.put((job, documents))
            return job.model_copy()

    def get(self, job_id: str) -> IngestJob:
        with self.lock:
            job = self.running.get(job_id) or self.records.get(job_id)
            if job is None:
                raise JobNotFound(f"no ingest job {job_id!r} (a finished job is kept until {KEPT_JOBS} more "
                                  "have finished)")
            return self._reported([job])[0]

    def listed(self) -> list[IngestJob]:
        """Every job recorded in the store, this server's and others', oldest first."""
        with self.lock:
            return self._reported(self.records.all())

    def cancel(self, job_id: str) -> IngestJob:
        """Cancel one of this server's jobs: it stops at its next step (what it added stays)."""
        job = self.get(job_id)
        with self.lock:
            if job_id in self.running:
                job = self.running[job_id]
                job.status, job.finished = "cancelled", time.time()
                self._finish(job)
            elif job.active:
                raise JobConflict(f"ingest job {job_id!r} runs on the server {job.server}: cancel it there")
            return job.model_copy()

    def close(self) -> None:
        """The server stops: its jobs under way are recorded as interrupted and stop at their next step, which this
        waits for (at most CLOSE_WAIT_S): a thread still computing while Python exits would abort the process."""
        with self.lock:
            self.closed.set()
            for job in list(self.running.values()):
                stopped = job.interrupted("the server stopped", time.time())
                job.status, job.error, job.finished = stopped.status, stopped.error, stopped.finished
                self._finish(job)
            self.todo.put(None)
        for thread in self.threads:
            thread.join(CLOSE_WAIT_S)
            if thread.is_alive():
                log.warning("the %s thread still runs %.0f s after its server stopped", thread.name, CLOSE_WAIT_S)

    def _reported(self, jobs: list[IngestJob]) -> list[IngestJob]:
        """The jobs as they stand: this server's from its memory; another's under way, from a server silent for
        STALE_S, as interrupted."""
        now, out = time.time(), []
        for job in jobs:
            if job.id in self.running:
                job = self.running[job.id].model_copy()
            elif job.active and now - (heard := job.heartbeat or job.created) > STALE_S:
                job = job.interrupted(f"its server {job.server} stopped (last heard from {now - heard:.0f} s ago)",
                                      heard)
            out.append(job)
        return out

    def _finish(self, job: IngestJob) -> None:
        """Record the job's outcome; it is no longer this server's to run. Called with the lock held."""
        self.records.put(job)
        self.running.pop(job.id, None)

    def _work(self) -> None:
        if sys.platform == "linux":  # questions first: this thread, and the threads it starts, at a lower CPU priority
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + JOB_NICE))
        while (item := self.todo.get()) is not None:
            job, documents = item
            with self.lock:
                if job.status != "queued":  # cancelled while it waited
                    continue
                job.status = "running"
                self.records.put(job)
            try:
                for start in range(0, len(documents), JOB_PART):
                    if job.status != "running":  # cancelled, or the server stops
                        break
                    added = self.ingest(documents[start:start + JOB_PART], lambda: job.status != "running")
                    with self.lock:
                        job.done, job.added = min(start + JOB_PART, len(documents)), job.added + added
                        self.records.put(job)
                outcome, error = "done", None
            except Exception as err:  # the job fails, the server goes on
                if job.status == "running":
                    log.error("ingest job %s failed", job.id, exc_info=err)
                outcome, error = "failed", f"{type(err).__name__}: {err}"
            with self.lock:
                if job.status == "running":
                    job.status, job.error, job.finished = outcome, error, time.time()
                    self._finish(job)

    def _beat(self) -> None:
        """Refresh the records of this server's jobs under way, so that other servers see it is alive."""
        while not self.closed.wait(HEARTBEAT_S):
            with self.lock:
                for job in self.running.values():
                    job.heartbeat = time.time()
                    try:
                        self.records.put(job)
                    except Exception as err:  # the store is down: the job's own writes will fail it
                        log.warning("could not refresh the record of ingest job %s: %s", job.id, err)


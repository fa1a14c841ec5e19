"""Background ingest jobs (POST /ingest/jobs of `nugget-rag serve`), kept beside the nugget store so that they outlive
their server: each job's record, its documents and its claims (job_records.py), where every server over the same
store reads them. A server runs its jobs one at a time in a worker thread, a part (JOB_PART documents, read back from
the store) a step, and records each step.

A server refreshes its jobs' `heartbeat` every HEARTBEAT_S. A job still queued or running whose server stopped (shut
down, a process of this host that is gone, or silent for STALE_S) is reported "interrupted", with what it had
ingested, and can resume: `resume_stale` (a server starting over the job's index) or `resume` (`nugget-rag jobs
resume ID`) claims the job's next attempt (of two servers at once one wins, the other gets JobConflict) and ingests
the parts not done yet. The ingest skips the chunks already indexed and the compressor the states already stored, so
each document is compressed and indexed once. A server that finds its job claimed by another stops it. A job that is
done or cancelled drops its documents; a failed or interrupted one keeps them until it resumes or is dropped
(KEPT_JOBS).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable

from langchain_core.documents import Document

from ..cancellation import Stop
from ..state.redaction import redacted
from .job_records import IngestJob, JobRecords

log = logging.getLogger(__name__)

JOB_PART = 32  # documents an ingest job keeps in one part, and adds, and publishes, per step
MAX_JOBS = 16  # ingest jobs queued or running at once on one server
KEPT_JOBS = 100  # finished jobs whose records stay readable
JOB_NICE = 10  # how much nicer than the server the thread that runs ingest jobs is (Linux)
HEARTBEAT_S = 10.0  # how often a server refreshes the records of its jobs under way
STALE_S = 3 * HEARTBEAT_S  # a job under way whose record is older than this: its server stopped
CLOSE_WAIT_S = 60.0  # how long a stopping server waits for the step its job has under way
YIELD_S = 2.0  # the longest a job waits, before each of its batches, while the server has requests in flight


class IngestJobError(Exception):
    """A request about ingest jobs that cannot be met (the server maps each kind to its HTTP status)."""


class JobNotFound(IngestJobError, LookupError):
    """No job has this id (or its record was dropped)."""


class JobConflict(IngestJobError):
    """The job cannot be changed here: another server runs it, or resumes it."""


class JobsUnavailable(IngestJobError):
    """This server takes no more jobs now: it is shutting down, or MAX_JOBS are under way."""


class JobNotResumable(IngestJobError):
    """The job cannot resume: its record is of an earlier version, it ingests into another index, or it ended."""


def server_gone(server: str) -> bool:
    """Whether `server` ("host:process id") was a process of this host that no longer runs."""
    host, _, pid = server.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        return False
    return False


def stopped_why(job: IngestJob, now: float) -> str | None:
    """Why a job under way that another server runs has stopped (its server is gone, or silent for STALE_S); None:
    it has not."""
    heard = job.heartbeat or job.created
    if job.active and (server_gone(job.server) or now - heard > STALE_S):
        return f"its server {job.server} stopped (last heard from {now - heard:.0f} s ago)"
    return None


def interrupted(job: IngestJob, why: str, at: float) -> IngestJob:
    """`job`, reported as stopped with its server at `at`: what it had ingested stays."""
    then = (f": it resumes when a server over its index starts (or `nugget-rag jobs resume {job.id}`), else send the "
            "rest again" if job.parts is not None else ": send the rest again")
    return job.model_copy(update={
        "status": "interrupted", "finished": at,
        "error": f"{why} before the job ended: {job.done} of {job.documents} documents were ingested ({job.added} "
                 f"new chunks){then}"})


def reported(job: IngestJob, now: float) -> IngestJob:
    """A job that another server runs, as it stands: interrupted if that server stopped."""
    why = stopped_why(job, now)
    return job if why is None else interrupted(job, why, job.heartbeat or job.created)


class IngestJobs:
    """This server's ingest jobs, run one at a time by a worker thread (started with the first) through
    `ingest(documents, stop)`, which stops at its next step once `stop()` is true; every change is written to
    `records`, which also hold the jobs of other servers over the same store. `index`: the directory of the index
    the jobs ingest into (None: an index in memory), which a job records, and which a resumed job must name.
    `busy`: whether the server has requests in flight; questions first, a job waits before each of its batches while
    it has (at most YIELD_S a batch, so that a steady stream of questions still lets it on)."""

    def __init__(self, ingest: Callable[[list[Document], Stop], int], records: JobRecords, index: str | None = None,
                 busy: Callable[[], bool] | None = None):
        self.ingest, self.records, self.index, self.busy = ingest, records, index, busy
        self.server = f"{socket.gethostname()}:{os.getpid()}"
        self.claimant = f"{self.server}/{uuid.uuid4().hex[:8]}"  # who this is in a job's claims
        self.running: dict[str, IngestJob] = {}  # this server's jobs queued or running
        self.lock = threading.Lock()  # held to change a job and write its record
        self.todo: queue.Queue[IngestJob | None] = queue.Queue()  # None: the worker ends
        self.closed = threading.Event()
        self.threads: list[threading.Thread] = []  # the worker and the heartbeat, started with the first job

    @property
    def active(self) -> int:
        with self.lock:
            return len(self.running)

    def submit(self, documents: list[Document]) -> IngestJob:
        """A new job of `documents`, kept in the store in parts, then queued."""
        with self.lock:
            self._check_open()
            job = IngestJob(id=f"ingest-{uuid.uuid4().hex}", documents=len(documents), server=self.server,
                            heartbeat=time.time(), parts=math.ceil(len(documents) / JOB_PART), index=self.index)
            try:
                for part in range(job.parts):
                    self.records.put_documents(job.id, part, documents[part * JOB_PART:(part + 1) * JOB_PART])
            except BaseException:
                self.records.drop_documents(job.id)
                raise
            self.records.put(job)
            recorded = self.records.all()
            finished = [j.id for j in self._reported(recorded) if not j.active]
            self.records.delete(finished[:max(0, len(finished) - KEPT_JOBS)])
            self.records.drop_orphans({j.id for j in recorded})
            return self._start(job)

    def resume(self, job_id: str) -> IngestJob:
        """Take over a job that stopped with its server (interrupted, or its server silent) or failed: claim its next
        attempt, then run the parts it had not done. JobNotFound; JobConflict where its server still runs it, or
        another server claimed it first; JobNotResumable saying why it cannot resume (a record of an earlier version,
        another index, a job that ended)."""
        with self.lock:
            self._check_open()
            if (running := self.running.get(job_id)) is not None:
                if running.active:
                    return running.model_copy()
                self._finish(running)  # it ended while the store was down: its outcome is recorded first
            job = self.records.get(job_id)
            if job is None:
                raise JobNotFound(f"no ingest job {job_id!r} in the store (a finished job is kept until {KEPT_JOBS} "
                                  "more have finished)")
            self._check_resumable(job)
            attempt = job.attempt + 1
            while (claim := self.records.claim(job_id, attempt, self.claimant)).by != self.claimant:
                if time.time() - claim.at <= STALE_S:
                    raise JobConflict(f"ingest job {job_id!r} is being resumed by the server "
                                      f"{claim.by.partition('/')[0]}")
                attempt += 1  # its claimant stopped before it recorded the job: the next attempt is free
            job = job.model_copy(update={"status": "queued", "attempt": attempt, "server": self.server,
                                         "heartbeat": time.time(), "error": None, "finished": None})
            self.records.put(job)
            log.info("resuming ingest job %s: %d of %d documents were ingested", job_id, job.done, job.documents)
            return self._start(job)

    def resume_stale(self) -> list[IngestJob]:
        """Resume every job over this server's index that stopped with its server (what a server does as it
        starts); returns them. A job another server claims first, or that cannot resume, is logged and left."""
        if self.index is None:
            return []
        now, resumed = time.time(), []
        for job in self.records.all():
            stopped = job.status == "interrupted" or stopped_why(job, now) is not None
            ours = job.index == self.index or job.parts is None  # an earlier version's: its error is logged
            if job.id in self.running or not stopped or not ours:
                continue
            try:
                resumed.append(self.resume(job.id))
            except (JobConflict, JobNotResumable) as err:
                log.warning("ingest job %s was not resumed: %s", job.id, err)
        return resumed

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
        """The server stops: its jobs under way are recorded as interrupted (to resume) and stop at their next step,
        which this waits for (at most CLOSE_WAIT_S): a thread still computing while Python exits would abort the
        process."""
        with self.lock:
            self.closed.set()
            for job in list(self.running.values()):
                stopped = interrupted(job, "the server stopped", time.time())
                job.status, job.error, job.finished = stopped.status, stopped.error, stopped.finished
                self._finish(job)
            self.todo.put(None)
        for thread in self.threads:
            thread.join(CLOSE_WAIT_S)
            if thread.is_alive():
                log.warning("the %s thread still runs %.0f s after its server stopped", thread.name, CLOSE_WAIT_S)

    def _check_open(self) -> None:
        """Called with the lock held."""
        if self.closed.is_set():
            raise JobsUnavailable("the server is shutting down; submit the job to another one")
        if len(self.running) >= MAX_JOBS:
            raise JobsUnavailable(f"{MAX_JOBS} ingest jobs are queued or running; retry once one is done")

    def _check_resumable(self, job: IngestJob) -> None:
        if job.parts is None:
            raise JobNotResumable(
                f"ingest job {job.id!r} was recorded by an earlier version of nugget-rag, which kept its documents "
                f"only in its server's memory: it cannot resume. {job.done} of its {job.documents} documents were "
                f"ingested ({job.added} new chunks); send the rest again")
        if job.index is not None and job.index != self.index:
            raise JobNotResumable(f"ingest job {job.id!r} ingests into the index in {job.index}, not "
                                  f"{self.index or 'an index in memory'}; resume it over that index")
        if job.status in ("done", "cancelled"):
            raise JobNotResumable(f"ingest job {job.id!r} is {job.status}: there is nothing to resume")
        if job.active and stopped_why(job, time.time()) is None:
            raise JobConflict(f"ingest job {job.id!r} runs on the server {job.server}, heard from "
                              f"{time.time() - (job.heartbeat or job.created):.0f} s ago; it can resume once that "
                              f"server has been silent for {STALE_S:.0f} s")

    def _start(self, job: IngestJob) -> IngestJob:
        """Queue `job`, this server's now (the threads start with the first). Called with the lock held."""
        self.running[job.id] = job
        if not self.threads:
            self.threads = [threading.Thread(target=self._work, name="ingest-jobs", daemon=True),
                            threading.Thread(target=self._beat, name="ingest-jobs-heartbeat", daemon=True)]
            for thread in self.threads:
                thread.start()
        self.todo.put(job)
        return job.model_copy()

    def _reported(self, jobs: list[IngestJob]) -> list[IngestJob]:
        """The jobs as they stand: this server's from its memory, others' as `reported`."""
        now = time.time()
        return [self.running[job.id].model_copy() if job.id in self.running else reported(job, now) for job in jobs]

    def _owns(self, job: IngestJob) -> bool:
        return self.running.get(job.id) is job

    def _finish(self, job: IngestJob) -> None:
        """Record the job's outcome; it is no longer this server's to run. Called with the lock held."""
        self.records.put(job)
        self.running.pop(job.id, None)
        if job.status in ("done", "cancelled"):  # nothing to resume: its documents go
            self.records.drop_documents(job.id)

    def _work(self) -> None:
        if sys.platform == "linux":  # questions first: this thread, and the threads it starts, at a lower CPU priority
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + JOB_NICE))
        while (job := self.todo.get()) is not None:
            with self.lock:
                if job.status != "queued":  # cancelled while it waited
                    continue
                job.status = "running"
                self.records.put(job)
            try:
                self._run(job)
                outcome, error = "done", None
            except Exception as err:  # the job fails, the server goes on
                if job.status == "running":
                    log.error("ingest job %s failed", job.id, exc_info=err)
                outcome, error = "failed", f"{type(err).__name__}: {redacted(str(err))}"
            with self.lock:
                if job.status == "running" and self._owns(job):
                    job.status, job.error, job.finished = outcome, error, time.time()
                    try:
                        self._finish(job)
                    except Exception as err:  # the store is down: the heartbeat records the outcome once it is back
                        log.error("could not record that ingest job %s %s: %s", job.id, job.status,
                                  redacted(str(err)))

    def _run(self, job: IngestJob) -> None:
        """Ingest the job's parts, from the first it had not done (a resumed job's are done up to `job.done`)."""
        seen = 0
        for part in range(job.parts or 0):
            if job.status != "running":  # cancelled, the server stops, or another server resumed it
                return
            documents = self.records.documents(job.id, part)
            if documents is None:
                raise JobNotResumable(f"part {part} of the documents of ingest job {job.id!r} is no longer in the "
                                      f"store; {seen} of {job.documents} documents were read: send the rest again")
            if seen + len(documents) <= job.done:  # done before the job resumed
                seen += len(documents)
                continue
            added = self.ingest(documents, lambda: self._yield_to_requests() or job.status != "running")
            seen += len(documents)
            with self.lock:
                job.done, job.added = seen, job.added + added
                if self._owns(job):
                    self.records.put(job)

    def _yield_to_requests(self) -> None:
        """Wait while the server has requests in flight, at most YIELD_S (called between the job's batches)."""
        deadline = time.monotonic() + YIELD_S
        while self.busy is not None and self.busy() and time.monotonic() < deadline:
            time.sleep(0.01)

    def _beat(self) -> None:
        """Refresh the records of this server's jobs under way, so that other servers see it is alive; a job another
        server has claimed meanwhile (this one was silent too long) is left to it: it stops at its next step."""
        while not self.closed.wait(HEARTBEAT_S):
            with self.lock:
                for job in list(self.running.values()):
                    try:
                        if not job.active:  # ended while the store was down: its outcome is recorded now
                            self._finish(job)
                            continue
                        claim = self.records.claimed(job.id, job.attempt + 1)
                        if claim is not None:
                            log.warning("ingest job %s was resumed by the server %s; this one stops it", job.id,
                                        claim.by.partition("/")[0])
                            job.status = "interrupted"
                            del self.running[job.id]
                            continue
                        job.heartbeat = time.time()
                        self.records.put(job)
                    except Exception as err:  # the store is down: the job's own writes will fail it
                        log.warning("could not refresh the record of ingest job %s: %s", job.id, err)

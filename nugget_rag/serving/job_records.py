"""Ingest jobs as they are kept beside a nugget store, where every server over the same store reads them: each job's
record (JSON), its documents in parts of a few documents each (so a large job is no one giant value), and the claims
of the servers that resume it.

    a directory store   jobs/<id>.json, jobs/<id>/part-<n>.json, jobs/<id>/claim-<attempt>, jobs/<id>/written.json
    a Redis store       hash <namespace>:ingest-jobs (a field a record), hash <namespace>:ingest-job:<id>
                        (fields part:<n>, claim:<attempt>), hash <namespace>:ingest-job-written (a field a job
                        whose documents are kept: when a part was last written)
    any other store     this process's memory

A claim is atomic: an exclusive file create (O_CREAT | O_EXCL) in a directory, HSETNX in Redis; of the servers that
claim one attempt at a job, one wins. Documents kept for a job that was never recorded (its server stopped in
between) are dropped ORPHAN_AGE_S later. Nothing read here runs code: records and parts are JSON.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Literal

from langchain_core.documents import Document
from pydantic import BaseModel, Field, ValidationError

from ..state.files import write_atomic
from ..state.store import NuggetStore

log = logging.getLogger(__name__)

JOBS_FOLDER = "jobs"  # in a directory store
JOB_ID = re.compile(r"ingest-[0-9a-f]{32}")
ORPHAN_AGE_S = 3600.0  # documents of a job never recorded (its server stopped in between) are dropped this much later


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
    parts: int | None = Field(None, description="The parts its documents are kept in, beside its record; None: a "
                              "record of an earlier version, whose documents lived in its server's memory only.")
    index: str | None = Field(None, description="The directory of the index it ingests into; None: an index kept in "
                              "memory.")
    attempt: int = Field(0, description="How many times it was resumed.")

    @property
    def active(self) -> bool:
        return self.status in ("queued", "running")


class JobClaim(BaseModel):
    """Who claimed an attempt at a job, and when."""

    by: str
    at: float = Field(default_factory=time.time)


class JobRecords:
    """IngestJob records, their documents and claims beside `store`'s nugget states (the module's docstring)."""

    def __init__(self, store: NuggetStore):
        location = store.location
        self._redis = store.redis_client
        self._namespace = location.namespace if self._redis is not None else ""
        directory = location.directory if location is not None else None
        self._folder = directory / JOBS_FOLDER if directory is not None else None
        self._memory: dict[str, str] = {}  # where there is neither: records,
        self._memory_job: dict[tuple[str, str], str] = {}  # and (job id, field) -> part or claim
        self._memory_lock = threading.Lock()

    # ------------------------------------------------------------------ records
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
        if not JOB_ID.fullmatch(job_id):
            return None
        if self._redis is not None:
            data = self._redis.hget(self._hash, job_id)
        elif self._folder is not None:
            data = _read(self._folder / f"{job_id}.json")
        else:
            data = self._memory.get(job_id)
        return None if data is None else self._parse(job_id, data)

    def all(self) -> list[IngestJob]:
        """Every job recorded, oldest first."""
        if self._redis is not None:
            found = {key.decode(): data for key, data in self._redis.hgetall(self._hash).items()}
        elif self._folder is not None:
            found = {path.stem: data for path in self._folder.glob("ingest-*.json")
                     if (data := _read(path)) is not None}  # None: deleted meanwhile (by another server)
        else:
            found = dict(self._memory)
        jobs = [self._parse(job_id, data) for job_id, data in found.items()]
        return sorted((job for job in jobs if job is not None), key=lambda job: job.created)

    def delete(self, ids: list[str]) -> None:
        """Forget the jobs `ids`: their records, documents and claims."""
        if not ids:
            return
        for job_id in ids:
            self.drop_documents(job_id)
        if self._redis is not None:
            self._redis.hdel(self._hash, *ids)
        elif self._folder is not None:
            for job_id in ids:
                (self._folder / f"{job_id}.json").unlink(missing_ok=True)
        else:
            for job_id in ids:
                self._memory.pop(job_id, None)

    # ------------------------------------------------------------------ documents and claims
    def put_documents(self, job_id: str, part: int, documents: list[Document]) -> None:
        """Keep part `part` of a job's documents (JSON: their text, metadata and id)."""
        try:
            data = json.dumps([{"page_content": d.page_content, "metadata": d.metadata, "id": d.id}
                               for d in documents])
        except (TypeError, ValueError) as err:
            raise ValueError(f"the documents of an ingest job are kept as JSON, and their metadata is not JSON "
                             f"({err}); give metadata of strings, numbers, lists and objects") from None
        self._set(job_id, f"part-{part}", data, exclusive=False)
        if self._redis is not None:  # one hash of every job's time, so that finding orphans scans no keyspace
            self._redis.hset(self._written_hash, job_id, str(time.time()))
        else:
            self._set(job_id, "written", str(time.time()), exclusive=False)

    def drop_orphans(self, recorded: set[str], older_than_s: float = ORPHAN_AGE_S) -> list[str]:
        """Delete the documents of jobs not in `recorded` (the ids of every record, as `all()` read them), last
        written over `older_than_s` ago (a server stopped between keeping a job's documents and recording it; younger
        ones may be a submit under way); their ids."""
        orphans = [job_id for job_id, written in self._written().items() if job_id not in recorded
                   and time.time() - written > older_than_s]
        for job_id in orphans:
            log.warning("dropped the documents of ingest job %s, which was never recorded", job_id)
            self.drop_documents(job_id)
        return orphans

    def documents(self, job_id: str, part: int) -> list[Document] | None:
        """Part `part` of a job's documents, or None where it is not kept."""
        data = self._get(job_id, f"part-{part}")
        return None if data is None else [Document(**d) for d in json.loads(data)]

    def drop_documents(self, job_id: str) -> None:
        """Delete a job's documents and claims (it ended, or its record is dropped)."""
        if self._redis is not None:
            self._redis.delete(self._job_hash(job_id))
            self._redis.hdel(self._written_hash, job_id)
        elif self._folder is not None:
            shutil.rmtree(self._folder / job_id, ignore_errors=True)
        else:
            with self._memory_lock:
                for key in [key for key in self._memory_job if key[0] == job_id]:
                    del self._memory_job[key]

    def claim(self, job_id: str, attempt: int, by: str) -> JobClaim:
        """Claim attempt `attempt` at a job for `by`, atomically: the claim that holds, `by`'s where this call won."""
        wanted = JobClaim(by=by)
        self._set(job_id, f"claim-{attempt}", wanted.model_dump_json(), exclusive=True)
        held = self.claimed(job_id, attempt)
        return held if held is not None else wanted

    def claimed(self, job_id: str, attempt: int) -> JobClaim | None:
        """The claim of attempt `attempt` at a job, if any."""
        data = self._get(job_id, f"claim-{attempt}")
        return None if data is None else JobClaim.model_validate_json(data)

    # ------------------------------------------------------------------ where they live
    def _written(self) -> dict[str, float]:
        """When the documents of each job that has some kept were last written (0: not recorded)."""
        if self._redis is not None:
            return {key.decode(): float(value) for key, value in self._redis.hgetall(self._written_hash).items()}
        if self._folder is not None:
            ids = [path.name for path in self._folder.glob("ingest-*") if path.is_dir()]
        else:
            with self._memory_lock:
                ids = sorted({job_id for job_id, _ in self._memory_job})
        return {job_id: float(self._get(job_id, "written") or 0) for job_id in ids}

    @property
    def _hash(self) -> str:
        return f"{self._namespace}:ingest-jobs"

    @property
    def _written_hash(self) -> str:
        return f"{self._namespace}:ingest-job-written"

    def _job_hash(self, job_id: str) -> str:
        return f"{self._namespace}:ingest-job:{job_id}"

    def _set(self, job_id: str, name: str, data: str, exclusive: bool) -> None:
        """Write a job's part or claim; `exclusive`: only where there is none yet."""
        if self._redis is not None:
            field = name.replace("-", ":", 1)
            (self._redis.hsetnx if exclusive else self._redis.hset)(self._job_hash(job_id), field, data)
        elif self._folder is not None:
            folder = self._folder / job_id
            folder.mkdir(parents=True, exist_ok=True)
            if not exclusive:
                write_atomic(folder / f"{name}.json", data)
                return
            written = folder / f"{name}~{os.getpid()}-{threading.get_ident()}"
            write_atomic(written, data)
            try:  # a hard link is made whole or not at all, and never over an existing name (also over NFS)
                os.link(written, folder / name)
            except FileExistsError:
                pass
            finally:
                written.unlink()
        else:
            with self._memory_lock:
                if not exclusive or (job_id, name) not in self._memory_job:
                    self._memory_job[job_id, name] = data

    def _get(self, job_id: str, name: str) -> str | bytes | None:
        if self._redis is not None:
            return self._redis.hget(self._job_hash(job_id), name.replace("-", ":", 1))
        if self._folder is not None:
            path = self._folder / job_id / (name if name.startswith("claim-") else f"{name}.json")
            return _read(path) or None
        with self._memory_lock:
            return self._memory_job.get((job_id, name))

    @staticmethod
    def _parse(job_id: str, data: bytes | str) -> IngestJob | None:
        try:
            return IngestJob.model_validate_json(data)
        except ValidationError as err:
            log.warning("the record of ingest job %s is malformed and was ignored: %s", job_id, err)
            return None


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


__all__ = ["JOBS_FOLDER", "JOB_ID", "IngestJob", "JobClaim", "JobRecords"]

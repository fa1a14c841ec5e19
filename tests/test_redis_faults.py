"""Redis killed and restarted under a publish and under an ingest job, on a real redis-server (tests/redis_server.py,
its append-only file synced at every write, as a production server keeps one): nothing committed is lost, the error
names the store's address, the same process publishes again at once, and the job resumes, indexing each document
once. Skipped, saying why, where redis-server or the redis client is missing."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest
from redis_server import RedisServer
from test_published_index import DOCS, handle

from nugget_rag import NuggetStore, StoreUnavailableError
from nugget_rag.integrations.published import lock as locks
from nugget_rag.integrations.published import publishing as index_publishing
from nugget_rag.integrations.published.check import check_index
from nugget_rag.serving import ingest_jobs
from nugget_rag.serving.job_records import JobRecords


@pytest.fixture(scope="module")
def model():
    from tiny import tiny_nugget_model

    return tiny_nugget_model()


@pytest.fixture
def server(tmp_path):
    server = RedisServer(tmp_path)  # start() skips, saying why, where it cannot run here
    server.start()
    yield server
    server.stop()


def kill(server: RedisServer) -> None:
    """SIGKILL: no shutdown, no last save; what it had written is in its append-only file."""
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(10)
    server.process = None


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def sources(model, url: str) -> list[str]:
    return sorted(d.metadata["source"] for d in handle(model, url, None).current().documents)


def test_redis_killed_mid_publish_loses_nothing_committed_and_the_publish_goes_again(model, server, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setattr(locks, "LOCK_TTL_S", 30)  # a lock left behind would hold the next publish 30 s
    writer = handle(model, server.url, tmp_path / "cache")
    writer.ingest(DOCS[:2])
    writer.ingest(DOCS[2:4])
    committed = writer.current().ids
    put = index_publishing.put

    def dying(store, key, value):  # the server dies under the publish's first segment
        if "/segments/" in key and server.process is not None:
            kill(server)
        put(store, key, value)

    monkeypatch.setattr(index_publishing, "put", dying)
    with pytest.raises(StoreUnavailableError, match=rf"nugget store redis://127\.0\.0\.1:{server.port}/0"):
        writer.ingest(DOCS[4:8])
    monkeypatch.setattr(index_publishing, "put", put)
    server.start()  # the same port and folder: its append-only file brings back what was written
    reader = handle(model, server.url, tmp_path / "empty")
    assert reader.record.version == 2 and reader.current().ids == committed  # the commit before, whole
    assert check_index(NuggetStore.from_redis(server.url)).ok
    started = time.monotonic()
    assert writer.ingest(DOCS[4:8]) == 4
    assert time.monotonic() - started < 20, "the publish waited for the lock it left behind"
    assert sources(model, server.url) == [f"note{i}" for i in range(8)]


def test_redis_killed_mid_ingest_job_names_it_and_the_job_resumes_each_document_once(model, server, monkeypatch):
    monkeypatch.setattr(ingest_jobs, "JOB_PART", 2)
    monkeypatch.setattr(ingest_jobs, "HEARTBEAT_S", 0.2)
    index = handle(model, server.url, None)
    parts: list[list[str]] = []

    def pipeline(working, documents):  # the server dies as the job's second part is compressed
        parts.append([d.metadata["source"] for d in documents])
        if len(parts) == 2:
            kill(server)
        return working.ingest(documents)

    index.pipeline = pipeline
    jobs = ingest_jobs.IngestJobs(index.ingest, JobRecords(index.compressor.store), index=index.location)
    try:
        job = jobs.submit(DOCS[:6])
        eventually(lambda: jobs.get(job.id).status == "failed", "the job fails")
        failed = jobs.get(job.id)
        assert failed.done == 2 and f"redis://127.0.0.1:{server.port}/0" in failed.error, failed.error
        server.start()
        assert sources(model, server.url) == ["note0", "note1"]  # the first part, committed before the kill
        assert jobs.resume(job.id).attempt == 1
        eventually(lambda: jobs.get(job.id).status == "done", "the resumed job ends")
    finally:
        jobs.close()
    assert sources(model, server.url) == [f"note{i}" for i in range(6)]  # each document once
    recorded = JobRecords(NuggetStore.from_redis(server.url)).get(job.id)
    assert (recorded.status, recorded.done, recorded.added) == ("done", 6, 6)
    assert parts == [["note0", "note1"], ["note2", "note3"], ["note2", "note3"], ["note4", "note5"]]

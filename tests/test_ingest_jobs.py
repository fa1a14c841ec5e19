"""Ingest jobs that outlive their server: documents kept in the store in parts, a stale job resumed by one server of
many (an atomic claim), old records refused by name, and a server SIGKILLed mid-job whose job the next server
finishes, each document compressed once and indexed once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from langchain_core.documents import Document
from test_integrations import HashEmbeddings
from tiny import tiny_nugget_model

from nugget_rag import NuggetCompressor, NuggetStore, cli
from nugget_rag.integrations import NuggetIndex
from nugget_rag.serving import ingest_jobs, job_records
from nugget_rag.serving.ingest_jobs import IngestJobs, JobConflict, JobNotResumable, server_gone
from nugget_rag.serving.job_records import IngestJob, JobRecords

TESTS = Path(__file__).parent
INDEX = "/srv/the-index"  # the index the jobs of these tests ingest into
DOCUMENTS = [Document(page_content=f"Note {i} on the mill.", metadata={"n": i}) for i in range(70)]  # 3 parts of 32


@pytest.fixture(params=["memory", "directory", "redis"])
def records(request, tmp_path) -> JobRecords:
    """Job records over a store in memory (shared by the IngestJobs given the same records), a directory, Redis."""
    if request.param == "memory":
        return JobRecords(NuggetStore())
    if request.param == "directory":
        return JobRecords(NuggetStore(directory=tmp_path / "store"))
    from redis_server import RedisServer  # skips, saying why, where redis-server or the client is missing

    server = RedisServer(tmp_path)
    server.start()
    request.addfinalizer(server.stop)
    return JobRecords(NuggetStore.from_redis(server.url))


class Ingested:
    """A fake ingest that records the documents of each call; `hold`: calls wait until it is set."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.stops: list = []

    def __call__(self, documents: list[Document], stop) -> int:
        self.stops.append(stop)
        self.hold.wait(60)
        self.calls.append([d.page_content for d in documents])
        return len(documents)


def eventually(check, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def recorded(records: JobRecords, **fields) -> IngestJob:
    """A job of DOCUMENTS that another server recorded, its documents kept in parts as a server keeps them."""
    job = IngestJob(**{"id": f"ingest-{'ab' * 16}", "status": "running", "documents": len(DOCUMENTS), "parts": 3,
                       "index": INDEX, "server": "elsewhere:7", "heartbeat": time.time() - 60, **fields})
    for part in range(3):
        records.put_documents(job.id, part, DOCUMENTS[32 * part:32 * (part + 1)])
    records.put(job)
    return job


def finished(jobs: IngestJobs, job_id: str) -> IngestJob:
    eventually(lambda: not jobs.get(job_id).active, f"job {job_id} ended")
    return jobs.get(job_id)


def test_a_job_waits_between_batches_while_the_server_has_requests_in_flight(monkeypatch):
    monkeypatch.setattr(ingest_jobs, "YIELD_S", 0.3)
    busy_until, batches = time.monotonic() + 0.5, []

    def ingest(documents, stop) -> int:  # two batches, each checked before it starts
        for _ in range(2):
            assert not stop()
            batches.append(time.monotonic())
        return len(documents)

    jobs = IngestJobs(ingest, JobRecords(NuggetStore()), index=INDEX, busy=lambda: time.monotonic() < busy_until)
    assert finished(jobs, jobs.submit(DOCUMENTS[:3]).id).status == "done"
    assert batches[0] - busy_until > -0.25  # waited for the questions, at most YIELD_S a batch
    assert batches[1] >= busy_until  # then went on
    always = IngestJobs(ingest, JobRecords(NuggetStore()), index=INDEX, busy=lambda: True)
    assert finished(always, always.submit(DOCUMENTS[:3]).id).status == "done"  # a steady stream still lets it on
    jobs.close()
    always.close()


def test_a_job_keeps_its_documents_in_parts_until_it_is_done(records):
    ingest = Ingested()
    ingest.hold.clear()
    jobs = IngestJobs(ingest, records, index=INDEX)
    job = jobs.submit(DOCUMENTS)
    assert (job.parts, job.index) == (3, INDEX)
    assert [len(records.documents(job.id, part)) for part in range(3)] == [32, 32, 6]
    assert records.documents(job.id, 2)[5] == DOCUMENTS[69]  # text, metadata and id, read back
    ingest.hold.set()
    assert (finished(jobs, job.id).status, finished(jobs, job.id).done) == ("done", 70)
    assert ingest.calls == [[d.page_content for d in DOCUMENTS[i:i + 32]] for i in (0, 32, 64)]
    assert records.documents(job.id, 0) is None  # done: its documents are dropped
    jobs.close()


def test_a_stale_job_resumes_from_the_parts_it_had_not_done(records):
    job = recorded(records, done=32, added=30)
    ingest = Ingested()
    jobs = IngestJobs(ingest, records, index=INDEX)
    assert [j.id for j in jobs.resume_stale()] == [job.id]
    done = finished(jobs, job.id)
    assert (done.status, done.done, done.added, done.attempt, done.server) == ("done", 70, 68, 1, jobs.server)
    assert ingest.calls == [[d.page_content for d in DOCUMENTS[i:i + 32]] for i in (32, 64)]  # not the first part
    jobs.close()


def test_a_job_whose_server_is_heard_from_is_not_taken(records):
    job = recorded(records, heartbeat=time.time() - 5)
    jobs = IngestJobs(Ingested(), records, index=INDEX)
    assert jobs.resume_stale() == []
    with pytest.raises(JobConflict, match=f"runs on the server elsewhere:7, heard from [0-9]+ s ago.*silent for "
                                          f"{ingest_jobs.STALE_S:.0f} s"):
        jobs.resume(job.id)
    assert jobs.get(job.id).status == "running" and records.get(job.id).attempt == 0


def test_a_job_whose_server_process_is_gone_resumes_at_once(records):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    server = f"{socket.gethostname()}:{gone.pid}"
    assert server_gone(server) and not server_gone(f"{socket.gethostname()}:{os.getpid()}")
    job = recorded(records, heartbeat=time.time(), server=server)  # heard from just now, but its process is gone
    jobs = IngestJobs(Ingested(), records, index=INDEX)
    assert [j.id for j in jobs.resume_stale()] == [job.id] and finished(jobs, job.id).status == "done"
    jobs.close()


def test_of_servers_resuming_one_job_at_once_one_wins(records):
    job = recorded(records)
    ingests = [Ingested() for _ in range(6)]
    servers = [IngestJobs(ingest, records, index=INDEX) for ingest in ingests]
    start, outcomes = threading.Barrier(len(servers)), []

    def resume(jobs: IngestJobs) -> None:
        start.wait()
        try:
            outcomes.append(jobs.resume(job.id).server)
        except JobConflict as err:  # it was claimed first, or it runs (claimed and recorded) by now
            outcomes.append(f"conflict: {err}")

    threads = [threading.Thread(target=resume, args=(jobs,)) for jobs in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    won = [jobs for jobs in servers if jobs.threads]  # its worker started
    assert len(won) == 1 and sum(o.startswith("conflict") for o in outcomes) == len(servers) - 1
    assert finished(won[0], job.id).status == "done"
    assert sum(len(ingest.calls) for ingest in ingests) == 3  # each part ingested once, by the winner
    for jobs in servers:
        jobs.close()


def test_a_claim_is_won_once_and_its_claimant_stopping_first_frees_the_next_attempt(records, monkeypatch):
    job = recorded(records)
    claims = []
    threads = [threading.Thread(target=lambda i=i: claims.append(records.claim(job.id, 1, f"server-{i}")))
               for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len({claim.by for claim in claims}) == 1  # every claimant was told the one winner
    # a claim older than STALE_S whose claimant never recorded the job (it stopped at once): the next attempt is free
    monkeypatch.setattr(ingest_jobs, "STALE_S", 0.05)
    time.sleep(0.1)
    jobs = IngestJobs(Ingested(), records, index=INDEX)
    assert jobs.resume(job.id).attempt == 2 and finished(jobs, job.id).status == "done"
    jobs.close()


def test_a_server_whose_job_another_resumed_stops_it_and_leaves_its_record(records, monkeypatch):
    monkeypatch.setattr(ingest_jobs, "HEARTBEAT_S", 0.05)
    ingest = Ingested()
    ingest.hold.clear()
    first = IngestJobs(ingest, records, index=INDEX)
    job = first.submit(DOCUMENTS)
    eventually(lambda: ingest.stops, "the first part began")
    records.claim(job.id, 1, "other:1/x")  # another server found this one silent and resumed the job
    eventually(lambda: ingest.stops[0](), "the first server stopped its job")
    assert first.active == 0
    records.put(records.get(job.id).model_copy(update={"server": "other:1", "attempt": 1}))  # the other's record
    ingest.hold.set()
    first.close()  # waits for the step under way to end: nothing of it is written, nor is the job interrupted here
    assert len(ingest.calls) == 1 and records.get(job.id).server == "other:1"
    assert records.get(job.id).status == "running"  # the other server's job


def test_an_old_record_without_its_documents_is_refused_by_name(records, caplog):
    old = {"id": f"ingest-{'cd' * 16}", "status": "running", "documents": 9, "done": 3, "added": 3,
           "created": time.time() - 90, "server": "elsewhere:7", "heartbeat": time.time() - 60}  # today's format
    assert IngestJob.model_validate_json(json.dumps(old)).parts is None  # read as a record without documents
    records.put(IngestJob.model_validate(old))
    jobs = IngestJobs(Ingested(), records, index=INDEX)
    with pytest.raises(JobNotResumable, match=f"ingest job 'ingest-{'cd' * 16}' was recorded by an earlier version "
                                              "of nugget-rag.*only in its server's memory: it cannot resume. 3 of its "
                                              "9 documents were ingested.*send the rest again"):
        jobs.resume(old["id"])
    assert jobs.resume_stale() == [] and "earlier version" in caplog.text  # logged, not a crash
    assert jobs.get(old["id"]).status == "interrupted" and "send the rest again" in jobs.get(old["id"]).error


def test_jobs_that_ended_or_ingest_elsewhere_are_not_resumed(records):
    done = recorded(records, status="done")
    jobs = IngestJobs(Ingested(), records, index="/srv/another-index")
    with pytest.raises(JobNotResumable, match="ingests into the index in /srv/the-index, not /srv/another-index"):
        jobs.resume(done.id)
    assert jobs.resume_stale() == []
    with pytest.raises(JobNotResumable, match="is done: there is nothing to resume"):
        IngestJobs(Ingested(), records, index=INDEX).resume(done.id)


# ---------------------------------------------------------------------------------------------- nugget-rag jobs
def tiny_compressor(store: NuggetStore) -> NuggetCompressor:
    return NuggetCompressor(model=tiny_nugget_model(),
                            store=store)


def test_nugget_rag_jobs_resume_finishes_an_interrupted_job_into_its_index(tmp_path, monkeypatch, capsys):
    index_dir = tmp_path / "index"
    compressor = tiny_compressor(NuggetStore(directory=index_dir / "nuggets"))
    resumer = compressor.model_copy(update={"store": NuggetStore(directory=index_dir / "nuggets")})  # the CLI's
    monkeypatch.setattr(cli.loading, "load_compressor", lambda args, store_dir=None: resumer)
    monkeypatch.setattr(cli.loading, "load_embeddings", lambda args: HashEmbeddings())
    with NuggetIndex.updating(index_dir, compressor, HashEmbeddings()) as index:
        index.ingest(DOCUMENTS[:32])  # the first part, ingested before its server stopped
    records = JobRecords(compressor.store)
    job = recorded(records, status="interrupted", done=32, added=32, index=str(index_dir.resolve()))
    assert cli.main(["jobs", "list", "--index", str(index_dir)]) == 0
    assert f"{job.id}  interrupted  32/70 documents" in capsys.readouterr().out
    assert cli.main(["jobs", "resume", job.id, "--index", str(index_dir), "-q"]) == 0
    assert f"ingest job {job.id} done: 70 of 70 documents ingested, 70 new chunks in all" in capsys.readouterr().out
    index = NuggetIndex.load(index_dir, compressor, HashEmbeddings())
    assert sorted(d.page_content for d in index.documents) == sorted(d.page_content for d in DOCUMENTS)
    assert resumer.store.stats["writes"] == 70 - 32  # the states of the documents not ingested before, once
    assert cli.main(["jobs", "resume", job.id, "--index", str(index_dir)]) == 2
    assert "is done: there is nothing to resume" in capsys.readouterr().err
    assert cli.main(["jobs", "resume", "--index", str(index_dir)]) == 2
    assert "give `jobs resume ID`" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- a killed server
SERVER = """
import json, os, signal, sys, threading
sys.path.insert(0, sys.argv[1])
import uvicorn
from test_integrations import HashEmbeddings
from tiny import tiny_nugget_model
from nugget_rag import NuggetCompressor, NuggetStore
from nugget_rag.serving import ingest_jobs, job_records
from nugget_rag.integrations import NuggetIndex
from nugget_rag.serving import create_app

url, index_dir, port, stall_after, stats = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
ingest_jobs.JOB_PART = 4
store = NuggetStore.from_redis(url)
put = store.put


def report():  # the store's stats, written whole (the test reads the file once it appears)
    with open(stats + "~", "w") as f:
        json.dump(store.stats, f)
    os.replace(stats + "~", stats)


def put_then_stall(text, state):  # after `stall_after` writes: stopped in the middle of a step, as if busy
    key = put(text, state)
    if store.stats["writes"] == stall_after:
        report()
        threading.Event().wait()
    return key


store.put = put_then_stall
model = tiny_nugget_model()
index = NuggetIndex.open(index_dir, NuggetCompressor(model=model, store=store), HashEmbeddings(), chunk_tokens=64,
                         chunk_overlap=0)
signal.signal(signal.SIGTERM, lambda *_: None)  # uvicorn raises the signal it stopped on again: the stats follow
uvicorn.run(create_app(index, index_dir, resume_jobs=True), port=port, log_level="warning")
report()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(redis_url: str, index_dir: Path, stall_after: int, stats: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = stats.with_suffix(".log")
    with log.open("w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", SERVER, str(TESTS), redis_url, str(index_dir), str(port),
                                    str(stall_after), str(stats)], stderr=stderr)
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            return call(f"{url}/health")["status"] == "ok"
        except OSError:
            return False

    eventually(answers, "the server answered", timeout_s=300)
    return process, url


def call(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.fixture
def redis_url(tmp_path):
    from redis_server import RedisServer  # skips, saying why, where redis-server or the client is missing

    server = RedisServer(tmp_path)
    server.start()
    yield server.url
    server.stop()


def test_a_job_of_a_killed_server_is_finished_by_the_next_each_document_compressed_and_indexed_once(redis_url,
                                                                                                   tmp_path):
    import redis

    texts = [f"Note {i}: the mill by the river grinds {i} sacks." for i in range(12)]  # a chunk each; 3 parts of 4
    index_dir, killed_stats, resumed_stats = tmp_path / "index", tmp_path / "killed.json", tmp_path / "resumed.json"
    killed, url = start_server(redis_url, index_dir, stall_after=6, stats=killed_stats)
    try:
        job = call(f"{url}/ingest/jobs", {"documents": texts})
        eventually(killed_stats.exists, "the server stopped in its job's second part", timeout_s=300)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(60)
    assert json.loads(killed_stats.read_text())["writes"] == 6  # the first part whole, half of the second
    record = JobRecords(NuggetStore.from_redis(redis_url)).get(job["id"])
    assert (record.status, record.done, record.server) == ("running", 4, job["server"])  # as it was killed

    resumer, url = start_server(redis_url, index_dir, stall_after=0, stats=resumed_stats)
    try:
        eventually(lambda: call(f"{url}/ingest/jobs/{job['id']}")["status"] == "done", "the job resumed and ended",
                   timeout_s=300)
        done = call(f"{url}/ingest/jobs/{job['id']}")
    finally:
        resumer.terminate()
        resumer.wait(60)
    assert (done["done"], done["added"], done["attempt"]) == (12, 12, 1) and done["server"] != job["server"]
    # compressed once: the resuming server wrote only the states the killed one had not
    assert json.loads(resumed_stats.read_text())["writes"] == 6
    store = NuggetStore.from_redis(redis_url)
    states = [key for key in store.byte_store.yield_keys() if len(key) == 64]
    assert len(states) == 12
    # indexed once: every chunk one entry, in the records and the vectors
    index = NuggetIndex.load(index_dir, tiny_compressor(store), HashEmbeddings())
    assert sorted(d.page_content for d in index.documents) == sorted(texts) and len(set(index.ids)) == 12
    assert index.vectorstore.index.ntotal == 12
    assert not redis.Redis.from_url(redis_url).exists(f"nugget-rag:ingest-job:{job['id']}")  # its documents: gone


def test_documents_kept_for_a_job_never_recorded_are_dropped_once_old(records, monkeypatch):
    orphan, young = f"ingest-{'cd' * 16}", f"ingest-{'ef' * 16}"
    with monkeypatch.context() as past:  # kept over an hour ago by a server that stopped before recording the job
        real = time.time
        past.setattr(time, "time", lambda: real() - job_records.ORPHAN_AGE_S - 60)
        records.put_documents(orphan, 0, DOCUMENTS[:2])
        job = recorded(records)  # recorded long ago too: kept
    records.put_documents(young, 0, DOCUMENTS[:2])  # a submit under way: its record comes next
    jobs = IngestJobs(Ingested(), records, index=INDEX)
    new = jobs.submit(DOCUMENTS[:3])  # each submit looks for orphans
    assert records.documents(orphan, 0) is None
    assert records.documents(young, 0) is not None and records.documents(job.id, 0) == DOCUMENTS[:32]
    assert finished(jobs, new.id).status == "done"
    jobs.close()

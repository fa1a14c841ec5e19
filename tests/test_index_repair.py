"""A damaged published index (integrations/published/check.py, verify.py), on a real redis-server: a publish never
builds on a missing or altered segment, `nugget-rag index check` names what is broken and `--repair` mends it or
publishes a consistent version without what is lost, and the job of a killed process resumes with only the store's
URL. Each test breaks the store as an operator or a fault would (SETRANGE, DEL, OOM, a full lock)."""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from langchain_core.documents import Document
from test_integrations import HashEmbeddings
from test_published_index import DOCS, handle

from nugget_rag import NuggetCompressor, NuggetStore, StoreUnavailableError, cli
from nugget_rag.components.compressor import METADATA_KEY
from nugget_rag.components.llm import NuggetLLM
from nugget_rag.integrations import build_qa_chain
from nugget_rag.integrations.published import publishing as index_publishing
from nugget_rag.integrations.published.check import check_index
from nugget_rag.integrations.published.index import PublishedIndex
from nugget_rag.integrations.published.lock import publish_lock
from nugget_rag.integrations.published.segments import DamagedIndexError, Pointer, pointer_key, segment_key, version_key
from nugget_rag.serving.job_records import JobRecords

TESTS = Path(__file__).parent
QUESTIONS = ["When does the sourdough bread rise?", "What guides ships home?", "What hunts pigeons?"]


@pytest.fixture(scope="module")
def model():
    from tiny import tiny_nugget_model

    return tiny_nugget_model()


@pytest.fixture
def redis_url(tmp_path):
    from redis_server import RedisServer  # skips, saying why, where redis-server or the client is missing

    server = RedisServer(tmp_path)
    server.start()
    yield server.url
    server.stop()


def client(url):
    import redis

    return redis.Redis.from_url(url)


def raw(url, key: str) -> bytes | None:
    return client(url).get(f"nugget-rag/{key}")


def segments_verify(url, index) -> bool:
    """Whether every segment of the version `index` holds is in the store, whole."""
    return all(hashlib.sha256(raw(url, segment_key("default", s.sha256)) or b"").hexdigest() == s.sha256
               for s in index.record.segments)


def answers(index) -> list[str]:
    """What the index answers (the tiny model, greedy), and from which sources."""
    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=4)
    chain = build_qa_chain(index.current(), llm, k=2, as_text=True)
    found = [sorted(d.metadata["source"] for d in index.as_retriever(k=2).invoke(q)) for q in QUESTIONS]
    return [f"{chain.invoke(q)} {found[i]}" for i, q in enumerate(QUESTIONS)]


@pytest.fixture
def cli_on(model, monkeypatch, tmp_path):
    """The CLI with the tiny model and the hash embeddings, this machine's cache under tmp_path."""
    monkeypatch.setattr(cli.loading, "load_compressor", lambda args, store_dir=None: NuggetCompressor(
        model=model, store=args.store.open(), ratio=args.ratio))
    monkeypatch.setattr(cli.loading, "load_embeddings", lambda args: HashEmbeddings())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


# ---------------------------------------------------------------------------------------------- publishing
def test_a_publish_over_an_altered_segment_writes_it_again(model, redis_url, tmp_path, caplog):
    writer = handle(model, redis_url, None)
    writer.ingest(DOCS[:2])
    writer.ingest(DOCS[2:3])
    first = segment_key("default", writer.record.segments[0].sha256)
    client(redis_url).setrange(f"nugget-rag/{first}", 101, b"X")  # one byte changed
    with caplog.at_level(logging.WARNING):
        assert writer.ingest(DOCS[3:4]) == 1
    assert f"{first} in the nugget store redis://" in caplog.text and "was altered: written again" in caplog.text
    assert segments_verify(redis_url, writer)
    reader = handle(model, redis_url, tmp_path / "empty")  # a machine with an empty cache
    assert len(reader) == 4 and reader.current().ids == writer.current().ids
    assert [d.metadata["source"] for d in reader.as_retriever(k=1).invoke("Jupiter storm and moons")] == ["note2"]


def test_a_deleted_segment_is_written_again_from_a_copy_or_nothing_is_published(model, redis_url, tmp_path):
    writer = handle(model, redis_url, tmp_path / "w")
    writer.ingest(DOCS[:2])
    writer.ingest(DOCS[2:3])
    first = segment_key("default", writer.record.segments[0].sha256)
    client(redis_url).delete(f"nugget-rag/{first}")
    # no copy here: the reader with an empty cache cannot load the version, and says so at once
    started = time.monotonic()
    with pytest.raises(DamagedIndexError, match=rf"{first} in the nugget store redis://\S+ is missing; version 2 "
                                                r"of the index 'default' lists it.*nugget-rag index check --store "
                                                r"'redis://\S+' --name default --repair"):
        handle(model, redis_url, tmp_path / "empty")
    assert time.monotonic() - started < 2
    pointer = raw(redis_url, pointer_key("default"))
    # the writer holds the version whole: its publish writes the segment again
    assert writer.ingest(DOCS[3:4]) == 1 and segments_verify(redis_url, writer)
    assert raw(redis_url, pointer_key("default")) != pointer
    assert len(handle(model, redis_url, tmp_path / "empty2")) == 4


def test_a_publisher_without_a_verified_copy_publishes_nothing(model, redis_url, tmp_path, monkeypatch):
    writer = handle(model, redis_url, None)
    writer.ingest(DOCS[:2])
    writer.ingest(DOCS[2:3])
    first = writer.record.segments[0]
    client(redis_url).delete(f"nugget-rag/{segment_key('default', first.sha256)}")
    pointer = raw(redis_url, pointer_key("default"))
    # the chunks it holds encode to other bytes (as after a change of format): no verified copy is left
    monkeypatch.setattr(index_publishing, "encode_segment", lambda chunks, vectors: b"not the segment")
    with pytest.raises(DamagedIndexError, match=r"is missing; version 2 .* holds no verified copy of it, so nothing "
                                                r"was published: version 2 stays current"):
        writer.ingest(DOCS[3:4])
    assert raw(redis_url, pointer_key("default")) == pointer  # never a version that lists a missing key


def test_a_damaged_cache_is_read_from_the_store_instead(model, redis_url, tmp_path, caplog):
    writer = handle(model, redis_url, tmp_path / "w")
    writer.ingest(DOCS[:3])
    cached = next((tmp_path / "w").glob("*.segment"))
    cached.write_bytes(cached.read_bytes()[:-1] + b"\1")
    with caplog.at_level(logging.WARNING):
        reader = handle(model, redis_url, tmp_path / "w")
    assert "is damaged: it is read from the store instead" in caplog.text
    assert reader.current().ids == writer.current().ids
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == cached.stem  # and cached again, whole


# ---------------------------------------------------------------------------------------------- check and repair
def test_a_lost_segment_is_named_then_repaired_and_ingested_again(model, redis_url, tmp_path, cli_on, capsys):
    writer = handle(model, redis_url, None)
    for part in (DOCS[:2], DOCS[2:4], DOCS[4:8]):
        writer.ingest(part)
    before = answers(writer)
    check = ["index", "check", "--store", redis_url]
    assert cli.main(check) == 0 and capsys.readouterr().out.strip().endswith("ok")
    lost = writer.record.segments[1]  # note2 and note3, in versions 2 and 3, and in no cache
    client(redis_url).delete(f"nugget-rag/{segment_key('default', lost.sha256)}")
    assert cli.main(check) == 1
    out = capsys.readouterr().out
    assert f"BROKEN: version 3: {segment_key('default', lost.sha256)} is missing (2 chunks from note2, note3)" in out
    assert "BROKEN: version 2:" in out and "--repair" in out
    assert cli.main([*check, "--repair"]) == 1  # consistent again, but chunks are lost
    out = capsys.readouterr().out
    assert "repaired: published version 4 (6 chunks) without 2 lost chunks, retiring the broken versions 2, 3" in out
    assert out.split("ingest these sources again:\n")[1].split("\n")[:2] == ["    note2", "    note3"]
    assert len(handle(model, redis_url, tmp_path / "empty")) == 6
    assert cli.main(check) == 0
    writer.ingest([d for d in DOCS if d.metadata["source"] in ("note2", "note3")])
    assert cli.main(check) == 0 and check_index(NuggetStore.from_redis(redis_url)).chunks == 8
    assert answers(handle(model, redis_url, tmp_path / "empty2")) == before


def three_versions(model, redis_url, **options):
    """A writer that published DOCS in three versions (note0-1, note2-3, note4-7), one segment each."""
    writer = handle(model, redis_url, None, **options)
    for part in (DOCS[:2], DOCS[2:4], DOCS[4:8]):
        writer.ingest(part)
    assert [s.sources for s in writer.record.segments] == [["note0", "note1"], ["note2", "note3"],
                                                            ["note4", "note5", "note6", "note7"]]
    return writer


def test_an_altered_record_that_parses_is_rebuilt_from_its_segments_keeping_every_chunk(model, redis_url, tmp_path,
                                                                                          cli_on, capsys):
    writer = three_versions(model, redis_url, keep_versions=3)
    before = answers(writer)
    record = f"nugget-rag/{version_key('default', 3)}"
    client(redis_url).append(record, b" ")  # its sha256 is not the pointer's, but it parses
    check = ["index", "check", "--store", redis_url]
    assert cli.main(check) == 1
    assert "it still parses, and 3 of its 3 segments verify: --repair rebuilds it from them" in capsys.readouterr().out
    assert cli.main([*check, "--repair"]) == 0
    out = capsys.readouterr().out
    assert "repaired: published version 4 (8 chunks) from version 3's altered record, rebuilt from its 3 segments " \
           "that verify, retiring the broken versions 3" in out and "ingest these sources again" not in out
    assert segments_verify(redis_url, writer)  # the segments only version 3 listed are kept: version 4 lists them
    pointer = Pointer.model_validate_json(raw(redis_url, pointer_key("default")))
    assert (pointer.version, pointer.kept, pointer.keep_versions) == (4, [1, 2], 3)  # the index's own keep_versions
    reader = handle(model, redis_url, tmp_path / "empty")
    assert len(reader) == 8 and reader.current().ids == writer.current().ids and answers(reader) == before
    assert cli.main(check) == 0


def test_an_altered_record_and_a_lost_segment_keep_what_verifies_and_name_the_rest(model, redis_url, tmp_path,
                                                                                     cli_on, capsys):
    writer = three_versions(model, redis_url)
    lost = writer.record.segments[1]
    client(redis_url).append(f"nugget-rag/{version_key('default', 3)}", b"\n")
    client(redis_url).delete(f"nugget-rag/{segment_key('default', lost.sha256)}")
    assert cli.main(["index", "check", "--store", redis_url, "--repair"]) == 1  # consistent, chunks lost
    out = capsys.readouterr().out
    assert "published version 4 (6 chunks) from version 3's altered record, rebuilt from its 2 segments that " \
           "verify (without 2 lost chunks)" in out
    assert out.split("ingest these sources again:\n")[1].split("\n")[:3] == ["    note2", "    note3", "consistent "
                                                                              "again, without the chunks above"]
    reader = handle(model, redis_url, tmp_path / "empty")
    assert sorted({d.metadata["source"] for d in reader.current().documents}) == [
        "note0", "note1", "note4", "note5", "note6", "note7"]


def test_a_record_that_does_not_parse_names_the_sources_only_it_held(model, redis_url, tmp_path, cli_on, capsys):
    three_versions(model, redis_url)
    key = f"nugget-rag/{version_key('default', 3)}"
    record = json.loads(raw(redis_url, version_key("default", 3)))
    record["segments"][0]["sha256"] = "not a sha256"
    client(redis_url).set(key, json.dumps(record).encode())
    assert cli.main(["index", "check", "--store", redis_url, "--repair"]) == 1
    out = capsys.readouterr().out
    assert "published version 4 (4 chunks) from the last intact record, retiring the broken versions 3" in out
    assert out.split("ingest these sources again:\n")[1].split("\n")[:4] == [f"    note{i}" for i in range(4, 8)]
    assert len(handle(model, redis_url, tmp_path / "empty")) == 4


def test_repair_writes_a_segment_again_from_this_machines_cache(model, redis_url, tmp_path, cli_on, capsys):
    from nugget_rag.integrations.published.index import cache_directory
    from nugget_rag.state.store import StoreLocation

    cache = cache_directory(StoreLocation.parse(redis_url))  # where `nugget-rag ask --store` caches, under XDG
    writer = handle(model, redis_url, cache)
    writer.ingest(DOCS[:3])
    key = segment_key("default", writer.record.segments[0].sha256)
    client(redis_url).setrange(f"nugget-rag/{key}", 60, b"?")
    assert cli.main(["index", "check", "--store", redis_url, "--repair"]) == 0
    assert f"repaired: wrote {key} again from the segment cache {cache}" in capsys.readouterr().out
    assert segments_verify(redis_url, writer) and writer.record.version == 1


def test_repair_rebuilds_a_segment_from_another_versions_chunks(model, redis_url, cli_on, capsys):
    writer = handle(model, redis_url, None)
    for doc in DOCS[:3]:
        writer.ingest([doc])
    assert writer.compact() and len(writer.record.segments) == 1  # version 4: one segment; version 3 kept: three
    merged = segment_key("default", writer.record.segments[0].sha256)
    client(redis_url).setrange(f"nugget-rag/{merged}", 80, b"#")
    state = writer.current().documents[0].metadata["nuggets"]["key"]
    client(redis_url).delete(f"nugget-rag/{state}")
    assert cli.main(["index", "check", "--store", redis_url, "--repair"]) == 0
    out = capsys.readouterr().out
    assert f"repaired: wrote {merged} again from the chunks of version 3" in out
    assert "warning: 1 of 3 chunks name a nugget state the store lacks" in out and out.strip().endswith("ok")
    assert segments_verify(redis_url, writer)


# ---------------------------------------------------------------------------------------------- bad input
def test_a_store_that_refuses_writes_mid_publish_leaves_the_version_before(model, redis_url, monkeypatch):
    writer = handle(model, redis_url, None)
    writer.ingest(DOCS[:2])
    pointer, before = raw(redis_url, pointer_key("default")), set(client(redis_url).keys("*segments*"))
    real = index_publishing.put

    def full_after_the_segments(store, key, value):  # the store fills up once the segments are written
        if "/versions/" in key:
            client(redis_url).config_set("maxmemory", 1)
        real(store, key, value)

    monkeypatch.setattr(index_publishing, "put", full_after_the_segments)
    with pytest.raises(StoreUnavailableError, match=r"could not write published-index/default/versions/0000000002 "
                                                    r"to the nugget store redis://\S+: .*used memory > .maxmemory.*"
                                                    r"the published index is as "
                                                    r"it was: make the store take writes"):
        writer.ingest(DOCS[2:4])
    assert raw(redis_url, pointer_key("default")) == pointer
    assert set(client(redis_url).keys("*segments*")) == before  # the segments it wrote: removed again
    client(redis_url).config_set("maxmemory", 0)
    monkeypatch.setattr(index_publishing, "put", real)
    assert writer.ingest(DOCS[2:4]) == 2


def test_a_segment_bigger_than_the_store_takes_is_refused_before_any_write(model, redis_url):
    writer = handle(model, redis_url, None)
    writer.ingest(DOCS[:1])
    pointer, before = raw(redis_url, pointer_key("default")), set(client(redis_url).keys("*published-index*"))
    client(redis_url).config_set("proto-max-bulk-len", 2**20)  # Redis's smallest: 1 MiB a value
    big = Document(page_content="A tall giraffe eats acacia leaves.", metadata={"source": "big.txt",
                                                                                  "scan": "x" * (2**20 + 1)})
    with pytest.raises(ValueError, match=r"segment published-index/default/segments/\w+ \(1 chunks from big.txt\) is "
                                         r"1,04\d,\d{3} bytes, more than the nugget store redis://\S+ takes in one "
                                         r"value \(1,048,576 bytes.*segment_bytes.*Nothing was published"):
        writer.ingest([big])
    assert raw(redis_url, pointer_key("default")) == pointer
    assert set(client(redis_url).keys("*published-index*")) == before


@pytest.mark.parametrize("namespace", ["team-a", ""])
def test_check_finds_the_nugget_states_under_the_stores_namespace(model, redis_url, namespace):
    store = NuggetStore.from_redis(redis_url, namespace=namespace)
    writer = PublishedIndex(NuggetCompressor(model=model, store=store), HashEmbeddings(), chunk_tokens=96,
                            chunk_overlap=0)
    writer.ingest(DOCS[:3])
    report = check_index(store)
    assert report.ok and report.chunks == 3 and report.warnings == []
    store.byte_store.mdelete([writer.current().documents[0].metadata[METADATA_KEY]["key"]])
    assert check_index(store).warnings[0].startswith("1 of 3 chunks name a nugget state the store lacks")


def test_check_of_a_name_that_is_not_published_names_those_that_are(model, redis_url, cli_on, capsys):
    handle(model, redis_url, None).ingest(DOCS[:1])
    assert cli.main(["index", "check", "--store", redis_url, "--name", "docs"]) == 2
    err = capsys.readouterr().err
    assert "no index named 'docs' is published in the nugget store redis://" in err
    assert "(published there: default); give --name NAME of one of them" in err


def test_repair_while_another_publisher_holds_the_lock_refuses_by_name(model, redis_url, cli_on, capsys):
    writer = handle(model, redis_url, None)
    writer.ingest(DOCS[:2])
    pointer = raw(redis_url, pointer_key("default"))
    held, release = threading.Event(), threading.Event()

    def publisher():
        with publish_lock(writer.compressor.store, "default"):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=publisher)
    thread.start()
    held.wait(10)
    try:
        assert cli.main(["index", "check", "--store", redis_url, "--repair", "--wait", "1"]) == 2
    finally:
        release.set()
        thread.join()
    assert "another process has held the publish lock of the index 'default' in redis://" in capsys.readouterr().err
    assert raw(redis_url, pointer_key("default")) == pointer
    assert cli.main(["index", "check", "--store", redis_url, "--repair", "--wait", "1"]) == 0  # free: nothing to do


# ---------------------------------------------------------------------------------------------- jobs
KILLED = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from test_integrations import HashEmbeddings
from tiny import tiny_nugget_model
from nugget_rag import NuggetCompressor, NuggetStore
from nugget_rag.integrations.published.index import PublishedIndex
from nugget_rag.serving import ingest_jobs
from nugget_rag.serving.job_records import JobRecords

ingest_jobs.JOB_PART = 2
index = PublishedIndex(NuggetCompressor(model=tiny_nugget_model(), store=NuggetStore.from_redis(sys.argv[2])),
                       HashEmbeddings(), chunk_tokens=96, chunk_overlap=0)
steps = []


def pipeline(working, documents):  # the second step stalls, as if busy, until the process is killed
    steps.append(1)
    if len(steps) == 2:
        print("stalled", flush=True)
        threading.Event().wait()
    return working.ingest(documents)


index.pipeline = pipeline
jobs = ingest_jobs.IngestJobs(index.ingest, JobRecords(index.compressor.store), index=index.location)
print(jobs.submit([{docs}]).id, flush=True)
threading.Event().wait()
"""


def test_jobs_resume_with_only_the_store_finishes_a_killed_job_each_document_once(model, redis_url, tmp_path,
                                                                                  cli_on, capsys):
    docs = ", ".join(f"Document(page_content={d.page_content!r}, metadata={d.metadata!r})" for d in DOCS[:6])
    script = KILLED.replace("{docs}", docs).replace("import sys, threading",
                                                    "import sys, threading\nfrom langchain_core.documents import "
                                                    "Document")
    killed = subprocess.Popen([sys.executable, "-c", script, str(TESTS), redis_url], stdout=subprocess.PIPE,
                              text=True)
    try:
        job_id = killed.stdout.readline().strip()
        assert killed.stdout.readline().strip() == "stalled", f"the process stopped: {job_id}"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(60)
    assert len(handle(model, redis_url, None)) == 2  # the first part, published
    assert cli.main(["jobs", "list", "--store", redis_url]) == 0
    assert f"{job_id}  interrupted" in capsys.readouterr().out
    assert cli.main(["jobs", "resume", job_id, "--store", redis_url, "-q"]) == 0
    assert f"ingest job {job_id} done: 6 of 6 documents ingested" in capsys.readouterr().out
    sources = [d.metadata["source"] for d in handle(model, redis_url, None).current().documents]
    assert sorted(sources) == [f"note{i}" for i in range(6)]  # each document once
    assert JobRecords(NuggetStore.from_redis(redis_url)).get(job_id).attempt == 1
    assert cli.main(["jobs", "list"]) == 2 and "jobs needs --index DIR" in capsys.readouterr().err

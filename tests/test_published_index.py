"""The index published in the nugget store (integrations/published/index.py): handles on one Redis store, each with
its own local cache directory and no filesystem in common, read and write the same versions, whole."""

import dataclasses
import hashlib
import json
import shutil
import threading

import numpy as np
import pytest
from langchain_core.documents import Document
from test_integrations import HashEmbeddings
from tiny import perturb_adapters, tiny_nugget_model

from nugget_rag import NuggetCompressor, NuggetStore, StoreUnavailableError
from nugget_rag.cancellation import RequestCancelled
from nugget_rag.integrations import prune
from nugget_rag.integrations.local.files import IndexFileError
from nugget_rag.integrations.local.own_faiss import faiss_vectors
from nugget_rag.integrations.published import publishing as index_publishing
from nugget_rag.integrations.published import segments as index_segments
from nugget_rag.integrations.published.index import PublishedIndex
from nugget_rag.integrations.published.publishing import PublishOptions
from nugget_rag.integrations.published.segments import pointer_key, segment_key, version_key
from nugget_rag.state.store import StoreLocation

TOPICS = ["falcon hunts pigeons over cliffs", "sourdough bread rises overnight", "jupiter storm spot moons",
          "glacier melts into valley lakes", "violin strings need rosin", "tomato plants want sunlight",
          "submarine dives under arctic ice", "lighthouse guides ships home"]
DOCS = [Document(page_content=f"Note {i}: the {topic}, every single evening.", metadata={"source": f"note{i}"})
        for i, topic in enumerate(TOPICS)]


@pytest.fixture(scope="module")
def model():
    return tiny_nugget_model()


@pytest.fixture
def redis_url(tmp_path):
    pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    from redis_server import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    yield server.url
    server.stop()


def handle(model, url, cache, embeddings=None, **options) -> PublishedIndex:
    """A published index as one node opens it: its own connection to the store, its own cache directory."""
    compressor = NuggetCompressor(model=model, store=NuggetStore.from_redis(url))
    return PublishedIndex(compressor, embeddings or HashEmbeddings(), PublishOptions(**options), cache_dir=cache,
                          chunk_tokens=96, chunk_overlap=0)


def keys(url, part: str) -> set[str]:
    return {k for k in NuggetStore.from_redis(url).byte_store.yield_keys() if f"/{part}/" in k}


def test_a_document_ingested_through_one_handle_is_found_by_another(model, redis_url, tmp_path):
    first, second = handle(model, redis_url, tmp_path / "a"), handle(model, redis_url, tmp_path / "b")
    assert len(first) == len(second) == 0
    assert first.ingest(DOCS[:3]) == 3 and first.ingest(DOCS[:3]) == 0  # known chunks: nothing new to publish
    found = second.as_retriever(k=1).invoke("Jupiter storm and moons")
    assert [d.metadata["source"] for d in found] == ["note2"] and len(second) == 3
    assert second.compressor.store.get_by_key(found[0].metadata["nuggets"]["key"]) is not None  # nuggets: Redis
    assert second.ingest(DOCS[3:4]) == 1 and len(first) == 4 and first.record.version == 2
    assert first.current().ids == second.current().ids
    cached = {p.name for p in (tmp_path / "a").iterdir()}
    assert cached == {p.name for p in (tmp_path / "b").iterdir()} and cached  # each node's own cache, the same
    assert cached == {f"{s.sha256}.segment" for s in second.record.segments}


def test_two_servers_over_one_redis_store_answer_what_either_ingested(model, redis_url, tmp_path):
    pytest.importorskip("fastapi", reason="the server needs the [serve] extra")
    from fastapi.testclient import TestClient

    from nugget_rag.serving import create_app

    def serve(cache) -> TestClient:  # a server on another node: the store's URL and the model, no shared files
        index = handle(model, redis_url, cache)
        return TestClient(create_app(index))

    with serve(tmp_path / "a") as first, serve(tmp_path / "b") as second:
        added = first.post("/ingest", json={"documents": [{"page_content": d.page_content, "metadata": d.metadata}
                                                            for d in DOCS[:4]]}).json()
        assert added == {"added": 4, "chunks": 4}
        assert second.get("/health").json()["chunks"] == 4
        whole = second.post("/ask", json={"question": "When does the sourdough bread rise?", "k": 1,
                                          "max_new_tokens": 4, "stream": False}).json()
        assert whole["sources"][0]["source"] == "note1"
        assert second.post("/ingest", json={"documents": [DOCS[5].page_content]}).json()["chunks"] == 5
        assert first.get("/health").json()["chunks"] == 5


def test_a_new_version_reads_only_the_segments_it_adds(model, redis_url, tmp_path, monkeypatch):
    writer = handle(model, redis_url, tmp_path / "w")
    writer.ingest(DOCS[:2])
    reader = handle(model, redis_url, None)  # no cache: what it reads comes from the store
    writer.ingest(DOCS[2:3])
    real, read = index_segments.get, []
    monkeypatch.setattr(index_segments, "get", lambda store, key: read.append(key) or real(store, key))
    assert len(reader) == 3
    assert [key for key in read if "/segments/" in key] == [segment_key("default", writer.record.segments[-1].sha256)]
    assert reader.current().ids == writer.current().ids
    assert np.array_equal(faiss_vectors(reader.current().vectorstore), faiss_vectors(writer.current().vectorstore))


@pytest.mark.parametrize("held", ["as published", "differing"])
def test_a_publish_reads_no_record_it_holds(model, redis_url, monkeypatch, held):
    writer = handle(model, redis_url, None)
    writer.ingest(DOCS[:2])
    writer.ingest(DOCS[2:3])  # version 2, keeping version 1
    if held == "differing":  # a copy that is not the record the pointer names (its sha256): read instead
        record = writer.record.model_copy(update={"manifest": {**writer.record.manifest, "note": "changed"}})
        writer._held = dataclasses.replace(writer._held, record=record)
    byte_store, read = writer.compressor.store.byte_store, []
    real = byte_store.mget
    monkeypatch.setattr(byte_store, "mget", lambda keys: read.extend(keys) or real(keys))
    assert writer.ingest(DOCS[3:4]) == 1
    kept = [version_key("default", 2)] if held == "differing" else []  # what to keep: version 2 stays
    assert [key for key in read if "/versions/" in key] == [*kept, version_key("default", 1)]  # 1: what to remove
    assert keys(redis_url, "versions") == {version_key("default", 2), version_key("default", 3)}
    assert keys(redis_url, "segments") == {segment_key("default", s.sha256) for s in writer.record.segments}


def test_a_question_racing_publishes_reads_one_version_whole(model, redis_url, tmp_path):
    writer, reader = handle(model, redis_url, tmp_path / "w"), handle(model, redis_url, tmp_path / "r")
    published, reads, done = [()], [], threading.Event()

    def read() -> None:
        while not done.is_set():
            index = reader.current()
            found = index.vectorstore.similarity_search("the evening", k=64) if len(index) else []
            reads.append((tuple(index.ids), len(index), index.vectorstore.index.ntotal if len(index) else 0,
                          {d.id for d in found}))

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for doc in DOCS:
            writer.ingest([doc])
            published.append(tuple(writer.current().ids))
    finally:
        done.set()
        thread.join()
    assert len(reads) > len(DOCS)
    for ids, count, vectors, found in reads:
        assert ids in published and count == vectors == len(ids) and found == set(ids)  # never a mix
    assert {ids for ids, *_ in reads} - {()}, "the reader saw no published version"


def test_questions_during_a_publish_take_the_version_it_hands_them(model, redis_url, tmp_path, monkeypatch, caplog):
    index = handle(model, redis_url, tmp_path / "a")
    index.ingest(DOCS[:1])
    real, seen = index_publishing.remove_versions, []

    def after_the_commit(*args):  # a question while the publish removes what it retired
        seen.append(len(index.current()))
        return real(*args)

    monkeypatch.setattr(index_publishing, "remove_versions", after_the_commit)
    with caplog.at_level("INFO", logger="nugget_rag.integrations.published.index"):
        index.ingest(DOCS[1:2])
    assert seen == [2] and "loaded version" not in caplog.text  # the new version, not loaded again by the question


def test_old_versions_are_removed_once_the_pointer_moves_on(model, redis_url, tmp_path):
    index = handle(model, redis_url, tmp_path / "a", keep_versions=2)
    for doc in DOCS[:4]:
        index.ingest([doc])
    store = NuggetStore.from_redis(redis_url)
    assert keys(redis_url, "versions") == {version_key("default", 3), version_key("default", 4)}
    pointer = json.loads(store.byte_store.mget([pointer_key("default")])[0])
    assert (pointer["version"], pointer["kept"]) == (4, [3])
    kept = {segment_key("default", s.sha256) for s in index.record.segments}
    assert keys(redis_url, "segments") == kept  # appended: version 3's segments are version 4's first ones


def test_a_reader_whose_version_is_removed_mid_load_loads_the_newest(model, redis_url, tmp_path, monkeypatch):
    writer = handle(model, redis_url, tmp_path / "w", keep_versions=1)
    writer.ingest(DOCS[:1])
    reader = handle(model, redis_url, tmp_path / "r", keep_versions=1)
    writer.ingest(DOCS[1:2])
    real, calls = index_publishing.read_version, []

    def slow_read(*args, **kwargs):  # two publishes land while the reader loads version 2
        calls.append(args[2])
        if len(calls) == 1:
            writer.ingest(DOCS[2:3])
            writer.ingest(DOCS[3:4])
        return real(*args, **kwargs)

    monkeypatch.setattr("nugget_rag.integrations.published.index.read_version", slow_read)
    assert len(reader) == 4 and calls == [2, 4] and reader.record.version == 4


def test_compaction_leaves_the_index_equal_and_removes_old_segments(model, redis_url, tmp_path):
    index = handle(model, redis_url, tmp_path / "a")
    for doc in DOCS[:4]:
        index.ingest([doc])
    before = index.current()
    old = keys(redis_url, "segments")
    assert len(index.record.segments) == 4 == len(old)
    assert index.compact() and not index.compact()  # a second compaction has nothing to merge
    assert len(index.record.segments) == 1 and index.record.version == 5
    fresh = handle(model, redis_url, tmp_path / "b").current()
    assert fresh.ids == before.ids and np.array_equal(faiss_vectors(fresh.vectorstore),
                                                      faiss_vectors(before.vectorstore))
    assert old < keys(redis_url, "segments")  # the version before is kept, its segments with it
    index.ingest(DOCS[4:5])
    assert not old & keys(redis_url, "segments") and len(index.record.segments) == 2


def test_many_small_segments_are_merged_as_they_are_published(model, redis_url, tmp_path):
    index = handle(model, redis_url, tmp_path / "a", max_small_segments=2)
    counts = []
    for doc in DOCS:
        index.ingest([doc])
        counts.append(len(index.record.segments))
    assert max(counts) == 2 and counts[:3] == [1, 2, 1]  # the third small segment merges the three
    assert [d.page_content for d in handle(model, redis_url, tmp_path / "b").current().documents] == \
        [d.page_content for d in DOCS]


def test_concurrent_ingests_through_two_handles_both_land(model, redis_url, tmp_path):
    both_added = threading.Barrier(2, timeout=120)

    def pipeline(index, documents):  # each adds its chunks to a copy of the same version, then publishes
        added = index.ingest(documents)
        both_added.wait()
        return added

    handles = [handle(model, redis_url, tmp_path / name) for name in "ab"]
    for h in handles:
        h.pipeline = pipeline
    added = {}
    threads = [threading.Thread(target=lambda h=h, i=i: added.setdefault(i, h.ingest(DOCS[2 * i:2 * i + 3])))
               for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(added.values()) == [2, 3]  # DOCS[2] is in both: the second publish adds it once
    reader = handle(model, redis_url, tmp_path / "c")
    assert sorted(d.metadata["source"] for d in reader.current().documents) == [f"note{i}" for i in range(5)]


# ---------------------------------------------------------------------------------------------- bad input
def test_a_store_that_does_not_answer_is_named(model, redis_url, tmp_path):
    from redis_server import free_port

    down = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailableError, match=f"cannot reach Redis at {down}"):
        StoreLocation.parse(down).open()
    index = handle(model, redis_url, tmp_path / "a")
    index.ingest(DOCS[:1])
    NuggetStore.from_redis(redis_url).byte_store.client.shutdown(nosave=True)
    with pytest.raises(StoreUnavailableError, match=r"could not read published-index/default/current from the "
                                                    r"nugget store redis://127\.0\.0\.1"):
        index.current()


def test_a_version_of_another_model_or_embeddings_is_refused(model, redis_url, tmp_path):
    handle(model, redis_url, tmp_path / "a").ingest(DOCS[:2])
    other = perturb_adapters(tiny_nugget_model())
    with pytest.raises(ValueError, match=r"'default' published in .* holds nuggets of .* at r = 4.0 \(fingerprint "
                                         r".*not of the model given"):
        handle(other, redis_url, tmp_path / "b")
    with pytest.raises(ValueError, match=r"built with embeddings 'hash-words-64', but 'other' were given"):
        handle(model, redis_url, tmp_path / "c", embeddings=HashEmbeddings("other"))


def rewrite_record(url, change) -> None:
    """Change the current version's record and point the pointer at it, as a faulty publisher would."""
    store = NuggetStore.from_redis(url).byte_store
    pointer = json.loads(store.mget([pointer_key("default")])[0])
    key = version_key("default", pointer["version"])
    record = json.loads(store.mget([key])[0])
    change(record)
    data = json.dumps(record).encode()
    pointer["sha256"] = hashlib.sha256(data).hexdigest()
    store.mset([(key, data), (pointer_key("default"), json.dumps(pointer).encode())])


@pytest.mark.parametrize("fault, message", [
    ("segment", r"segments/\w+ in the nugget store redis://.* is altered .*version 2 of the index .*--repair"),
    ("record", r"versions/0000000002 in the nugget store .* is not the record its pointer names"),
    ("count", r"counts 4 chunks, its manifest 3 and its segments 3: they do not belong together"),
    ("dimension", r"segments/\w+ in redis://.* holds vectors of dimension 64, its version record says 65"),
])
def test_a_version_whose_parts_disagree_is_refused_by_name(model, redis_url, tmp_path, fault, message):
    writer = handle(model, redis_url, tmp_path / "a")
    writer.ingest(DOCS[:2])
    reader = handle(model, redis_url, tmp_path / "b")
    writer.ingest(DOCS[2:3])
    store = NuggetStore.from_redis(redis_url).byte_store
    if fault == "segment":
        key = segment_key("default", writer.record.segments[-1].sha256)
        store.mset([(key, store.mget([key])[0][:-4] + b"\0\0\0\1")])
    elif fault == "record":
        store.mset([(version_key("default", 2), store.mget([version_key("default", 2)])[0] + b" ")])
    elif fault == "count":
        rewrite_record(redis_url, lambda record: record.update(count=4))
    else:
        rewrite_record(redis_url, lambda record: (record.update(dimension=65), record["manifest"].update(dimension=65)))
    with pytest.raises(IndexFileError, match=message):
        reader.current()
    assert (reader.record.version, reader.record.count) == (1, 2)  # the version it holds stays, whole


def test_a_publish_that_fails_before_its_commit_leaves_the_version_before(model, redis_url, tmp_path, monkeypatch):
    index = handle(model, redis_url, tmp_path / "a")
    index.ingest(DOCS[:2])
    real = index_publishing.put

    def fail_at_the_pointer(store, key, value):
        if key == pointer_key("default"):
            raise StoreUnavailableError("the store went away")
        real(store, key, value)

    monkeypatch.setattr(index_publishing, "put", fail_at_the_pointer)
    with pytest.raises(StoreUnavailableError, match="went away"):
        index.ingest(DOCS[2:4])
    reader = handle(model, redis_url, tmp_path / "b")
    assert len(reader) == 2 and len(index) == 2
    assert len(keys(redis_url, "segments")) == 1  # the failed publish's segment was removed again
    monkeypatch.setattr(index_publishing, "put", real)
    with pytest.raises(RequestCancelled):
        index.ingest(DOCS[2:4], stop=lambda: True)
    assert len(reader) == 2
    assert index.ingest(DOCS[2:4]) == 2 and len(reader) == 4
    assert keys(redis_url, "segments") == {segment_key("default", s.sha256) for s in index.record.segments}


def test_prune_keeps_the_states_of_the_published_chunks(model, redis_url, tmp_path):
    index = handle(model, redis_url, tmp_path / "a")
    index.ingest(DOCS[:2])
    index.compressor.invoke([DOCS[5]])  # a state no index references
    report = prune([], NuggetStore.from_redis(redis_url))
    assert report.removed == 1 and report.indexes == ["published-index/default"]
    store = NuggetStore.from_redis(redis_url)
    assert all(store.get_by_key(d.metadata["nuggets"]["key"]) is not None for d in index.current().documents)


def test_stores_that_cannot_keep_a_published_index_are_refused(model, redis_url):
    from langchain_core.vectorstores import InMemoryVectorStore

    with pytest.raises(ValueError, match=r"expires its keys after 60 s"):
        PublishedIndex(NuggetCompressor(model=model, store=NuggetStore.from_redis(redis_url, ttl=60)), HashEmbeddings())
    with pytest.raises(ValueError, match=r"in memory only"):
        PublishedIndex(NuggetCompressor(model=model), HashEmbeddings())
    with pytest.raises(ValueError, match=r"a user's vector store is shared by itself"):
        PublishedIndex(NuggetCompressor(model=model, store=NuggetStore.from_redis(redis_url)), HashEmbeddings(),
                       vectorstore=InMemoryVectorStore(HashEmbeddings()))
    with pytest.raises(ValueError, match=r"published index name 'My Index' is not"):
        PublishOptions(name="My Index")


@pytest.mark.parametrize("where", ["directory", "byte store"])
def test_a_directory_or_any_byte_store_publishes_too(model, tmp_path, where):
    from langchain_core.stores import InMemoryByteStore

    byte_store = InMemoryByteStore()  # one process's: its publishers take turns under a lock of the process

    def opened(cache):
        store = NuggetStore(directory=tmp_path / "store") if where == "directory" else NuggetStore(byte_store)
        return PublishedIndex(NuggetCompressor(model=model, store=store), HashEmbeddings(), cache_dir=cache)

    first, second = opened(tmp_path / "a"), opened(None)
    first.ingest(DOCS[:2])
    assert second.ingest(DOCS[1:3]) == 1
    assert [d.metadata["source"] for d in first.current().documents] == ["note0", "note1", "note2"]


def test_ask_and_serve_read_the_index_published_in_the_store(model, redis_url, tmp_path, monkeypatch, capsys):
    pytest.importorskip("fastapi", reason="the server needs the [serve] extra")
    import uvicorn
    from fastapi.testclient import TestClient

    from nugget_rag import cli

    monkeypatch.setattr(cli.loading, "load_compressor", lambda args, store_dir=None: NuggetCompressor(
        model=model, store=args.store.open(), ratio=args.ratio))
    monkeypatch.setattr(cli.loading, "load_embeddings", lambda args: HashEmbeddings())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cli.main(["ask", "anything?"]) == 2 and "--store REDIS_URL (the index published" in capsys.readouterr().err
    assert cli.main(["ask", "anything?", "--store", redis_url]) == 2
    assert "is empty; ingest documents into it first" in capsys.readouterr().err
    handle(model, redis_url, tmp_path / "a").ingest(DOCS[:4])
    question = ["ask", "When does the sourdough bread rise?", "-k", "1", "--max-new-tokens", "3"]
    assert cli.main([*question, "--store", redis_url]) == 0
    assert capsys.readouterr().out.split("Sources:\n")[1].strip().startswith("note1")
    cached = list((tmp_path / "cache" / "nugget-rag" / "published").glob("default-*/*.segment"))
    assert len(cached) == 1  # this machine's copy of the one segment
    given = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: given.update(app=app))
    assert cli.main(["serve", "--store", redis_url]) == 0
    assert "serving the index published in redis://" in capsys.readouterr().out
    with TestClient(given["app"]) as client:
        assert client.post("/ingest", json={"documents": [DOCS[5].page_content]}).json() == {"added": 1, "chunks": 5}
    assert len(handle(model, redis_url, tmp_path / "b")) == 5


def test_ingest_with_a_store_and_no_index_publishes_into_the_store(model, redis_url, tmp_path, monkeypatch, capsys):
    from nugget_rag import cli

    monkeypatch.setattr(cli.loading, "load_compressor", lambda args, store_dir=None: NuggetCompressor(
        model=model, store=args.store.open(), ratio=args.ratio))
    monkeypatch.setattr(cli.loading, "load_embeddings", lambda args: HashEmbeddings())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "docs"
    folder.mkdir()
    for doc in DOCS[:3]:
        (folder / f"{doc.metadata['source']}.txt").write_text(doc.page_content)
    assert cli.main(["ingest", str(folder)]) == 2
    assert "ingest needs --index DIR (a local index) or --store REDIS_URL" in capsys.readouterr().err
    ingest = ["ingest", str(folder), "--store", redis_url, "--chunk-tokens", "96", "--chunk-overlap", "0", "-q"]
    assert cli.main(ingest) == 0
    assert "Ingested 3 documents (3 new chunks) into the index 'default' published in redis://" in \
        capsys.readouterr().out
    reader = handle(model, redis_url, tmp_path / "reader")
    assert sorted(d.metadata["source"].rsplit("/", 1)[-1] for d in reader.current().documents) == \
        ["note0.txt", "note1.txt", "note2.txt"]
    assert cli.main(ingest) == 0 and "(0 new chunks)" in capsys.readouterr().out  # the same files: nothing new
    assert cli.main([*ingest, "--ratio", "2"]) == 2  # the published nuggets are at r = 4
    assert "holds nuggets at r = 4; ingest into an --index directory to use r = 2" in capsys.readouterr().err
    assert cli.main([*ingest[:4], "--chunk-tokens", "64"]) == 2
    assert "was chunked with chunk_tokens=96, not 64" in capsys.readouterr().err
    assert len(reader) == 3

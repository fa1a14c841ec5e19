"""A NuggetStore shared through a real Redis server (Debian's redis-server, started per test on a free port)."""

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

redis = pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (apt-get install redis-server)", allow_module_level=True)

from redis_server import RedisServer, free_port  # noqa: E402, F401
from tiny import tiny_base, tiny_nugget_model  # noqa: E402

from nugget_rag import NuggetCompressor, NuggetStore, StoreUnavailableError  # noqa: E402

TEXTS = [f"Document {i}: the river passes the mill {i} times a day." for i in range(6)]
WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from tiny import tiny_base
    from nugget_rag import NuggetCompressor, NuggetConfig, NuggetModel, NuggetStore
    model = NuggetModel(tiny_base(), NuggetConfig(ratio=4, scorer_layer=2, lora={{"rank": 4}}))
    store = NuggetStore.from_redis({url!r})
    NuggetCompressor(model=model, store=store).invoke({texts!r})
    print(store.stats["writes"])
""")


@pytest.fixture
def server(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def tiny_compressor(store: NuggetStore) -> NuggetCompressor:
    return NuggetCompressor(model=tiny_nugget_model(),
                            store=store)


def no_compute(*args, **kwargs):
    raise AssertionError("recomputed a state that the shared store holds")


def test_states_compressed_in_one_process_are_read_in_another_without_recompute(server, monkeypatch):
    script = WRITER.format(tests=str(Path(__file__).parent), url=server.url, texts=TEXTS)
    writer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert writer.returncode == 0, writer.stderr
    assert writer.stdout.split()[-1] == str(len(TEXTS))
    compressor = tiny_compressor(NuggetStore.from_redis(server.url))
    monkeypatch.setattr(compressor.model, "compress", no_compute)
    docs = compressor.invoke(TEXTS)
    assert [d.metadata["nuggets"]["n_tokens"] for d in docs] == [len(t) for t in TEXTS]
    assert compressor.store.stats["store_hits"] == len(TEXTS) and compressor.store.stats["misses"] == 0


def test_from_pretrained_takes_a_redis_backed_store(server):
    from langchain_community.storage import RedisStore

    compressor = NuggetCompressor.from_pretrained(
        None, base_model=tiny_base(), store=RedisStore(redis_url=server.url, namespace="shared"))
    compressor.invoke(TEXTS[:2])
    assert len(list(compressor.store.byte_store.yield_keys())) == 2


def test_redis_down_at_start_names_the_url():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailableError, match=url):
        NuggetStore.from_redis(url)


def test_redis_stopped_mid_ingest_gives_a_clear_error_and_a_rerun_recomputes_only_the_rest(server):
    compressor = tiny_compressor(NuggetStore.from_redis(server.url))
    compressor.invoke(TEXTS[:3])
    server.stop()
    with pytest.raises(StoreUnavailableError, match="could not (read|write) nugget state"):
        compressor.invoke(TEXTS[3:])
    server.start()  # the append-only file brings back what was written
    rerun = tiny_compressor(NuggetStore.from_redis(server.url))
    rerun.invoke(TEXTS)
    stats = rerun.store.stats  # a missing state is looked for as ranked and as an earlier version stored it
    assert (stats["memory_hits"], stats["store_hits"], stats["corrupt"], stats["writes"]) == (0, 3, 0, 3)


def test_a_foreign_value_under_a_state_key_is_corrupt_recomputed_and_overwritten(server, caplog):
    store = NuggetStore.from_redis(server.url)
    compressor = tiny_compressor(store)
    key = store.key(TEXTS[0], compressor.fingerprint)
    store.byte_store.client.set(f"nugget-rag/{key}", b"another application's value")
    with caplog.at_level("WARNING"):
        compressor.invoke(TEXTS[:1])
    assert store.stats["corrupt"] == 1 and "corrupt" in caplog.text
    assert NuggetStore.from_redis(server.url).get_by_key(key) is not None


def test_prune_keeps_the_states_of_every_index_saved_over_the_store(server, tmp_path):
    from langchain_core.documents import Document
    from test_integrations import HashEmbeddings

    from nugget_rag.integrations import NuggetIndex, prune

    store = NuggetStore.from_redis(server.url)
    compressor = tiny_compressor(store)
    indexes = {}
    for name, texts in (("a", TEXTS[:4]), ("b", TEXTS[2:])):  # TEXTS[2:4] in both
        indexes[name] = NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=64)
        indexes[name].ingest([Document(page_content=t, metadata={"source": t[:10]}) for t in texts])
        indexes[name].save(tmp_path / name)
    assert len(store.indexes()) == 2
    indexes["a"].delete(indexes["a"].ids[:3])  # TEXTS[0:3]; b still holds TEXTS[2]
    indexes["a"].save(tmp_path / "a")
    report = prune([tmp_path / "a"], store)
    assert (report.removed, report.kept, len(report.indexes)) == (2, 4, 2)
    assert [store.get(t, compressor.fingerprint) is not None for t in TEXTS] == [False, False, True, True, True, True]


def test_a_store_opens_at_its_parsed_location_under_its_prefix(server):
    from langchain_core.documents import Document

    from nugget_rag.serving.ingest_jobs import IngestJob, JobRecords
    from nugget_rag.state.store import StoreLocation

    location = StoreLocation.parse(f"{server.url}?namespace=docs")
    store = location.open()
    assert store.location == location and location.namespace == "docs"
    compressor = tiny_compressor(store)
    compressor.invoke([Document(page_content=TEXTS[0])])
    assert redis.Redis.from_url(server.url).exists(f"docs/{NuggetStore.key(TEXTS[0], compressor.fingerprint)}")
    JobRecords(store).put(IngestJob(id=f"ingest-{'ab' * 16}", documents=1))
    assert redis.Redis.from_url(server.url).hlen("docs:ingest-jobs") == 1


def test_ingest_jobs_are_recorded_in_redis_for_every_server_over_it(server):
    pytest.importorskip("fastapi", reason="the server needs the [serve] extra")
    from fastapi.testclient import TestClient
    from test_integrations import HashEmbeddings

    from nugget_rag.integrations import NuggetIndex
    from nugget_rag.serving import create_app
    from nugget_rag.serving.ingest_jobs import IngestJob, JobRecords

    def serve() -> TestClient:  # a server of its own over the shared store, as a restarted one or another host's
        store = NuggetStore.from_redis(server.url)
        return TestClient(create_app(NuggetIndex(tiny_compressor(store), HashEmbeddings(), chunk_overlap=0), None))

    with serve() as first:
        job_id = first.post("/ingest/jobs", json={"documents": TEXTS}).json()["id"]
        for _ in range(600):
            if first.get(f"/ingest/jobs/{job_id}").json()["status"] == "done":
                break
            time.sleep(0.05)
    store = NuggetStore.from_redis(server.url)
    silent = IngestJob(id=f"ingest-{'cd' * 16}", status="running", documents=9, done=3, added=3,
                       server="elsewhere:7", heartbeat=time.time() - 60)
    JobRecords(store).put(silent)
    with serve() as restarted:
        jobs = restarted.get("/ingest/jobs").json()["jobs"]
    assert [(j["id"], j["status"], j["added"]) for j in jobs] == [(job_id, "done", 6), (silent.id, "interrupted", 3)]
    assert "elsewhere:7 stopped" in jobs[1]["error"]
    assert redis.Redis.from_url(server.url).hlen("nugget-rag:ingest-jobs") == 2
    assert sorted(len(key) for key in store.byte_store.yield_keys()) == [64] * 6  # the states only

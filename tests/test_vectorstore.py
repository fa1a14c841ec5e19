"""The user's own vector store behind NuggetIndex (LangChain's InMemoryVectorStore), delete, and prune."""

from __future__ import annotations

import json
import warnings

import faiss
import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore
from test_integrations import DOCS, HashEmbeddings, forbid_compress

from nugget_rag import NuggetCompressor, NuggetLLM, NuggetStore, cli
from nugget_rag.integrations import NuggetIndex, VectorStoreSpec, build_qa_chain, prune
from nugget_rag.integrations.local.files import index_location
from nugget_rag.integrations.stores.user_store import from_store

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS

IN_MEMORY = "langchain_core.vectorstores.in_memory:InMemoryVectorStore"
QUESTIONS = {"What do falcons hunt?": "birds.txt", "What goes into sourdough bread dough?": "bread.txt",
             "Which planet has the great red spot storm?": "planets.txt"}
SHARED: dict[str, dict] = {}  # the vectors of `persistent_store`, kept between CLI commands as a server's would be


def persistent_store(embedding: Embeddings, name: str = "default") -> InMemoryVectorStore:
    """A vector store factory for --vectorstore: an InMemoryVectorStore whose vectors outlive the command."""
    store = InMemoryVectorStore(embedding)
    store.store = SHARED.setdefault(name, {})
    return store


class NoDeleteStore(InMemoryVectorStore):
    """A vector store that cannot delete (VectorStore.delete not implemented)."""

    delete = VectorStore.delete


@pytest.fixture
def vectors():
    return InMemoryVectorStore(embedding=HashEmbeddings())


@pytest.fixture
def index(compressor, vectors):
    index = NuggetIndex(compressor, vectorstore=vectors, chunk_tokens=64, chunk_overlap=8)
    index.ingest(DOCS)
    return index


def chunks_of(index: NuggetIndex, source: str) -> list[str]:
    return [d.id for d in index.documents if d.metadata["source"] == source]


def test_ingest_puts_vectors_and_records_in_the_users_store(index, vectors, compressor):
    assert index.vectorstore is vectors and index.embeddings is vectors.embeddings
    assert len(index) > len(DOCS) and list(vectors.store) == index.store_ids_of(index.ids)  # a UUID each chunk
    for chunk, held_id in zip(index.documents, index.store_ids_of(index.ids)):
        held = vectors.store[held_id]
        assert all(isinstance(v, (str, int, float, bool)) for v in held["metadata"].values())  # flat
        assert from_store(Document(id=held_id, page_content=held["text"], metadata=held["metadata"])) == chunk
        assert len(held["vector"]) == 64 and index.dimension == 64
        assert compressor.store.get_by_key(chunk.metadata["nuggets"]["key"]) is not None  # nuggets: the compressor's
    assert index.ingest(DOCS) == 0 and len(vectors.store) == len(index)  # nothing twice


@pytest.mark.parametrize("question, source", QUESTIONS.items())
def test_the_qa_chain_answers_from_the_users_store_and_the_nugget_store(index, vectors, tiny_model, monkeypatch,
                                                                        question, source):
    searched = []
    search = vectors.similarity_search
    monkeypatch.setattr(vectors, "similarity_search", lambda *a, **kw: searched.append(a[0]) or search(*a, **kw))
    forbid_compress(monkeypatch, tiny_model)  # every nugget read comes from the compressor's store
    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=4)
    answer = build_qa_chain(index, llm, k=2, resolution="uniform").invoke(question)
    assert searched == [question]
    sources = answer.response_metadata["sources"]
    assert len(sources) == 2 and {s["id"] for s in sources} <= set(index.ids)
    assert sources[0]["source"] == source
    records = {d.id: d for d in index.documents}
    assert answer.usage_metadata["input_token_details"]["cache_read"] == sum(
        index.compressor.store.get_by_key(records[s["id"]].metadata["nuggets"]["key"]).at_ratio(4).k for s in sources)


def test_delete_leaves_neither_vectors_nor_records_and_keeps_the_nuggets(index, vectors, tmp_path):
    gone = chunks_of(index, "birds.txt")
    keys = [d.metadata["nuggets"]["key"] for d in index.documents if d.id in gone]
    assert index.delete(gone) == len(gone) > 0
    assert not set(index.store_ids_of(gone)) & set(vectors.store) and not set(gone) & set(index.ids)
    assert set(vectors.store) == set(index.store_ids_of(index.ids)) and len(index) == len(vectors.store)
    assert all(d.metadata["source"] != "birds.txt"
               for d in index.as_retriever(k=len(index)).invoke("What do falcons hunt?"))
    assert all(index.compressor.store.get_by_key(k) is not None for k in keys)  # left to prune

    saved = index.save(tmp_path / "saved")
    manifest = json.loads((saved / "index.json").read_text())
    assert manifest["vectorstore"] == IN_MEMORY and manifest["count"] == len(index) and manifest["dimension"] == 64
    assert set(manifest["files"]) == {"docstore"}  # no FAISS file: the vectors are the store's
    loaded = NuggetIndex.load(saved, index.compressor, vectorstore=vectors)
    assert loaded.ids == index.ids and loaded.embeddings is vectors.embeddings
    first = loaded.ids[0]
    assert loaded.delete([first]) == 1 and first not in loaded.ids
    assert index.store_ids_of([first])[0] not in vectors.store


def test_delete_from_the_default_faiss(compressor, tmp_path):
    index = NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=8)
    index.ingest(DOCS)
    gone = chunks_of(index, "bread.txt")
    index.delete(gone)
    assert index.vectorstore.index.ntotal == len(index) and index.vectorstore.get_by_ids(gone) == []
    assert list(index.vectorstore.index_to_docstore_id.values()) == index.ids
    loaded = NuggetIndex.load(index.save(tmp_path / "saved"), NuggetCompressor(model=compressor.model),
                              HashEmbeddings())
    assert loaded.ids == index.ids and loaded.vectorstore.index.ntotal == len(index)


def test_prune_removes_only_the_states_no_index_references(index, tiny_model, tmp_path):
    store = NuggetStore(directory=tmp_path / "shared")
    compressor = NuggetCompressor(model=tiny_model, store=store, text_states=True)
    kept_index = NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=8)
    kept_index.ingest(DOCS)
    texts = [d.page_content for d in kept_index.documents]
    compressor.lookup(texts[-2:], 2.0)  # states of kept chunks at a finer floor: another fingerprint
    orphan = "A text no index holds."
    compressor.invoke([orphan])
    birds = chunks_of(kept_index, "birds.txt")
    birds_texts = [d.page_content for d in kept_index.documents if d.id in birds]
    kept_index.delete(birds)
    saved = kept_index.save(tmp_path / "a")  # its nuggets are copied to a/nuggets: prune the first store here
    before = set(store.byte_store.yield_keys())
    report = prune([saved], store)
    after = set(store.byte_store.yield_keys())
    removed = before - after
    assert report.removed == len(removed) > 0 and report.kept == len(after) and report.bytes_removed > 0
    assert report.indexes == [index_location(saved)] and report.forgotten == []
    assert removed == {store.key(t, fp) for t in [*birds_texts, orphan]
                       for fp in (compressor.fingerprint, compressor.stored_fingerprint(1.0, adapter=None))}
    remaining = [t for t in texts if t not in birds_texts]
    for text in remaining:  # every referenced state stays, at every floor and the text states
        assert store.get(text, compressor.fingerprint) is not None
        assert store.get(text, compressor.stored_fingerprint(1.0, adapter=None)) is not None
    assert {store.key(t, compressor.stored_fingerprint(2.0)) for t in texts[-2:]} <= after
    assert prune([saved], store).removed == 0  # nothing more to remove


def test_prune_keeps_what_a_registered_index_references_and_forgets_a_deleted_one(compressor, tiny_model, tmp_path):
    index = NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=8)
    index.ingest(DOCS)
    index.delete(chunks_of(index, "birds.txt"))
    index.save(tmp_path / "a")
    store = index.compressor.store  # tmp_path/store: the index's nuggets, where the deleted chunks' states still are
    other = NuggetIndex(NuggetCompressor(model=tiny_model), HashEmbeddings(), chunk_tokens=64, chunk_overlap=8)
    other.ingest(DOCS[:1])  # the birds chunks
    other.save(tmp_path / "b")
    store.register_index(index_location(tmp_path / "b"))
    report = prune([tmp_path / "a"], store)
    assert report.removed == 0 and report.forgotten == []  # b references the birds chunks
    store.register_index("another-host:/srv/index")
    before = set(store.byte_store.yield_keys())
    with pytest.raises(ValueError, match=r"index at another-host:/srv/index, which cannot be read on this host"):
        prune([tmp_path / "a"], store)
    assert set(store.byte_store.yield_keys()) == before  # nothing removed
    store.forget_index("another-host:/srv/index")
    for path in (tmp_path / "b").iterdir():  # b deleted: its registration is forgotten, its states removed
        if path.is_file():
            path.unlink()
    report = prune([tmp_path / "a"], store)
    assert report.forgotten == [index_location(tmp_path / "b")] and report.removed == len(chunks_of(other, "birds.txt"))
    assert store.indexes() == []


def test_a_store_of_another_dimension_is_refused_at_the_first_add(compressor):
    embeddings = HashEmbeddings()
    store = FAISS(embeddings, faiss.IndexFlatL2(7), InMemoryDocstore({}), {})
    index = NuggetIndex(compressor, vectorstore=store, chunk_tokens=64)
    with pytest.raises(ValueError, match=r"holds vectors of dimension 7, but the embeddings \(hash-words-64\) make "
                                         r"vectors of dimension 64"):
        index.ingest(DOCS)
    assert len(index) == 0 and store.index.ntotal == 0


def test_a_store_that_cannot_delete_deletes_nothing(compressor):
    store = NoDeleteStore(HashEmbeddings())
    index = NuggetIndex(compressor, vectorstore=store, chunk_tokens=64)
    index.ingest(DOCS)
    ids = index.ids
    with pytest.raises(ValueError, match=r"NoDeleteStore\) cannot delete by id.*nothing was deleted"):
        index.delete(ids[:2])
    assert index.ids == ids and list(store.store) == index.store_ids_of(ids)
    with pytest.raises(ValueError, match=r"not in the index, e.g. 'nope'; nothing was deleted"):
        NuggetIndex(compressor, vectorstore=InMemoryVectorStore(HashEmbeddings())).delete(["nope"])


def test_k_below_one_is_refused_naming_it(index):
    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=4)
    for k in (0, -2):
        with pytest.raises(ValueError, match=rf"k={k}: the number of chunks to retrieve must be an integer >= 1"):
            index.as_retriever(k=2).invoke("falcon", k=k)
        with pytest.raises(ValueError, match=rf"input_value={k}"):
            build_qa_chain(index, llm, k=k)


def test_opening_with_the_wrong_store_or_embeddings_is_refused(index, vectors, tmp_path):
    saved = index.save(tmp_path / "saved")
    with pytest.raises(ValueError, match=rf"keeps its vectors in the vector store {IN_MEMORY}; open it with that "
                                         r"store \(vectorstore=..., --vectorstore"):
        NuggetIndex.load(saved, index.compressor, HashEmbeddings())
    with pytest.raises(ValueError, match=r"lacks chunks of the index"):
        NuggetIndex.load(saved, index.compressor, vectorstore=InMemoryVectorStore(HashEmbeddings()))
    with pytest.raises(ValueError, match=r"embeds with 'hash-words-64', but embeddings='other' were given"):
        NuggetIndex(index.compressor, HashEmbeddings("other"), vectorstore=vectors)
    own = NuggetIndex(index.compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=8)
    own.ingest(DOCS[:1])
    with pytest.raises(ValueError, match=r"keeps its vectors in its own FAISS files, not in a " + IN_MEMORY):
        NuggetIndex.load(own.save(tmp_path / "own"), index.compressor, vectorstore=vectors)


def test_spec_builds_a_store_with_the_embeddings_and_names_bad_targets():
    embeddings = HashEmbeddings()
    built = VectorStoreSpec(target=IN_MEMORY).build(embeddings)
    assert isinstance(built, InMemoryVectorStore) and built.embeddings is embeddings
    shared = VectorStoreSpec(target="test_vectorstore:persistent_store", kwargs={"name": "spec"}).build(embeddings)
    assert shared.store is SHARED["spec"]
    with pytest.raises(ValueError, match="is not MODULE:NAME"):
        VectorStoreSpec(target="InMemoryVectorStore")
    with pytest.raises(ValueError, match=r"has no 'Nope'"):
        VectorStoreSpec(target="langchain_core.vectorstores:Nope").build(embeddings)
    with pytest.raises(ValueError, match=r"does not take the settings \['colour'\]"):
        VectorStoreSpec(target=IN_MEMORY, kwargs={"colour": "red"}).build(embeddings)
    with pytest.raises(ValueError, match=r"made a HashEmbeddings, not a LangChain VectorStore"):
        VectorStoreSpec(target="test_integrations:HashEmbeddings").build(embeddings)


def test_cli_ingest_ask_and_prune_over_the_users_store(capsys, tmp_path, tiny_model, tiny_cli):
    docs = tiny_cli
    index_dir = tmp_path / "index"
    store = ["--vectorstore", "test_vectorstore:persistent_store", "--vectorstore-kwargs", '{"name": "cli"}']
    assert cli.main(["ingest", str(docs), "--index", str(index_dir), "--chunk-tokens", "64", "-q", *store]) == 0
    manifest = json.loads((index_dir / "index.json").read_text())
    assert manifest["vectorstore"] == IN_MEMORY and len(SHARED["cli"]) == manifest["count"] > 0
    capsys.readouterr()
    assert cli.main(["ask", "What do falcons hunt?", "--index", str(index_dir), "-k", "1",
                     "--max-new-tokens", "2", "--resolution", "uniform", *store]) == 0
    assert "birds.txt" in capsys.readouterr().out.split("Sources:")[1]
    assert cli.main(["ask", "Falcon?", "--index", str(index_dir)]) == 2
    assert f"keeps its vectors in the vector store {IN_MEMORY}" in capsys.readouterr().err
    assert cli.main(["ask", "Falcon?", "--index", str(index_dir), "--vectorstore-kwargs", '{"name": "cli"}']) == 2
    assert "--vectorstore-kwargs are the settings of a --vectorstore MODULE:NAME" in capsys.readouterr().err

    index = NuggetIndex.load(index_dir, NuggetCompressor(model=tiny_model),
                             vectorstore=persistent_store(HashEmbeddings(), "cli"))
    birds = chunks_of(index, "birds.txt")
    index.delete(birds)
    index.save(index_dir)
    capsys.readouterr()
    assert cli.main(["prune", "--index", str(index_dir)]) == 0
    out = capsys.readouterr().out
    assert f"removed {len(birds)} states no index references" in out and f"kept {len(index)} states" in out


def test_an_index_saved_before_uuid_ids_still_loads_and_keeps_its_ids(index, vectors, tmp_path):
    saved = index.save(tmp_path / "saved")
    manifest = json.loads((saved / "index.json").read_text())
    del manifest["store_ids"], manifest["collection"]  # as saved before: chunk ids and nested metadata in the store
    (saved / "index.json").write_text(json.dumps(manifest))
    old = InMemoryVectorStore(HashEmbeddings())
    old.add_documents(index.documents, ids=index.ids)
    loaded = NuggetIndex.load(saved, index.compressor, vectorstore=old)
    assert loaded.store_ids_of(loaded.ids) == loaded.ids
    found = loaded.as_retriever(k=2).invoke("What do falcons hunt?")
    assert found[0].metadata["source"] == "birds.txt" and found[0].metadata["nuggets"]["key"]  # read as written
    birds = chunks_of(loaded, "birds.txt")
    assert loaded.delete(birds) == len(birds) and not set(birds) & set(old.store)
    assert loaded.ingest(DOCS) == len(birds) and set(old.store) == set(loaded.ids)  # added again, under their ids


def test_faiss_as_the_users_store_is_given_the_index_vectors(compressor):
    embeddings = HashEmbeddings()
    store = FAISS(embeddings, faiss.IndexFlatIP(64), InMemoryDocstore({}), {})
    index = NuggetIndex(compressor, vectorstore=store, chunk_tokens=64)
    index.ingest(DOCS)
    assert store.index.ntotal == len(index)
    assert embeddings.calls == -(-len(index) // index.batch_size)  # a call a batch: the store embedded nothing
    assert index.as_retriever(k=1).invoke("What do falcons hunt?")[0].metadata["source"] == "birds.txt"

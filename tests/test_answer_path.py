"""The answer path does its work once: each chunk's stored state is read from the NuggetStore once a question (by
the key the compressor step wrote), for invoke, streaming and batches, on the tiny model."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from langchain_core.documents import Document
from test_integrations import DOCS, HashEmbeddings
from tiny import tiny_nugget_model

from nugget_rag import NuggetCompressor, NuggetLLM, NuggetStore
from nugget_rag.components.compressor import METADATA_KEY
from nugget_rag.generation.batching import BatchedGenerator
from nugget_rag.integrations import NuggetIndex, build_qa_chain
from nugget_rag.resolution import QueryLikelihood, UniformResolution

QUESTIONS = ["Where does the falcon nest?", "What does the dough need?"]


class CountingStore(NuggetStore):
    """A NuggetStore counting its state lookups, by key, above its memory cache."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.looked_up: list[str] = []

    def get(self, text, fingerprint):
        self.looked_up.append(self.key(text, fingerprint))
        return super().get(text, fingerprint)

    def get_by_key(self, key):
        self.looked_up.append(key)
        return super().get_by_key(key)

    def counted(self) -> Counter:
        """The lookups since the last call, by key."""
        counts, self.looked_up = Counter(self.looked_up), []
        return counts


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    model = tiny_nugget_model()
    store = CountingStore(directory=tmp_path_factory.mktemp("store"))
    index = NuggetIndex(NuggetCompressor(model=model, store=store, text_states=True), HashEmbeddings(),
                        chunk_tokens=64, chunk_overlap=8)
    index.ingest(DOCS)
    return index


def chunk_keys(index: NuggetIndex) -> Counter:
    return Counter(d.metadata[METADATA_KEY]["key"] for d in index.documents)


def ask(chain, how: str, questions: list[str]) -> list:
    if how == "invoke":
        return [chain.invoke(q) for q in questions]
    if how == "stream":
        return ["".join(chain.stream(q)) for q in questions]
    if how == "ainvoke":
        return [asyncio.run(chain.ainvoke(q)) for q in questions]
    return chain.batch(questions)


@pytest.mark.parametrize("how", ["invoke", "stream", "ainvoke", "batch"])
def test_a_question_reads_each_retrieved_chunk_state_once(index, how):
    store = index.compressor.store
    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=2, resolution=UniformResolution())
    chain = build_qa_chain(index, llm, k=len(index), as_text=True)
    store.counted()
    answers = ask(chain, how, QUESTIONS)
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    # every chunk is retrieved and read as nuggets: one lookup a chunk a question, by the key its metadata names
    assert store.counted() == Counter({key: len(QUESTIONS) for key in chunk_keys(index)})


def test_the_batched_decoder_reads_each_chunk_state_once(index):
    store = index.compressor.store
    batcher = BatchedGenerator(index.compressor.model, max_batch=4, wait_s=0.05)
    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=2, resolution="uniform", batcher=batcher)
    chain = build_qa_chain(index, llm, k=len(index), as_text=True)
    store.counted()
    assert len(chain.batch(QUESTIONS)) == 2
    assert store.counted() == Counter({key: len(QUESTIONS) for key in chunk_keys(index)})


def test_the_default_reading_reads_the_probed_state_and_the_text_state_once(index):
    """The default policy probes every chunk's nuggets, then reads the likeliest chunk whole as text: each of those
    states is looked up once, the probed ones never again."""
    store, compressor = index.compressor.store, index.compressor
    llm = NuggetLLM(compressor=compressor, max_new_tokens=2, resolution=QueryLikelihood(expand_margin=0.3))
    chain = build_qa_chain(index, llm, k=len(index))
    store.counted()
    answer = chain.invoke(QUESTIONS[0])
    counts = store.counted()
    retrieved = index.as_retriever(k=len(index)).invoke(QUESTIONS[0])
    read_whole = [retrieved[s["index"]] for s in answer.response_metadata["sources"]]
    assert read_whole and all(s["read_as"] == "text" for s in answer.response_metadata["sources"])
    text_fingerprint = compressor.stored_fingerprint(1.0, adapter=None)
    text_keys = Counter(store.key(d.page_content, text_fingerprint) for d in read_whole)
    assert counts == chunk_keys(index) + text_keys


def test_documents_given_straight_to_the_llm_are_read_once_by_their_text(index):
    store = index.compressor.store
    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=2, resolution="uniform")
    texts = [d.page_content for d in index.documents]
    store.counted()
    llm.invoke({"documents": texts, "question": QUESTIONS[0]})
    assert store.counted() == chunk_keys(index)  # no metadata names a key: found by their text, once each


def test_a_state_the_store_lost_is_recomputed_by_the_llm(index, tmp_path):
    """The chain's compressor step passes the chunks unread; a chunk whose state the store no longer holds is
    compressed again when the answer reads it, and stored."""
    compressor = NuggetCompressor(model=index.compressor.model, store=CountingStore(directory=tmp_path))
    chunk = index.documents[0]
    key = chunk.metadata[METADATA_KEY]["key"]
    assert compressor.store.get_by_key(key) is None  # a store without it: the key names a state it lost
    llm = NuggetLLM(compressor=compressor, max_new_tokens=2, resolution="uniform")
    chain = build_qa_chain(lambda question: [chunk], llm)
    answer = chain.invoke(QUESTIONS[0])
    assert answer.usage_metadata["input_token_details"]["cache_read"] == 0  # compressed for this question
    assert compressor.store.get_by_key(key) is not None


def test_the_compressor_step_trusts_only_keys_naming_its_own_state_of_the_text(index):
    compressor = index.compressor
    trusting = compressor.model_copy(update={"trust_metadata_keys": True})
    chunk = index.documents[0]
    compressor.store.counted()
    assert trusting.invoke([chunk])[0].metadata == chunk.metadata
    assert compressor.store.counted() == Counter()  # passed unread
    edited = Document(page_content=chunk.page_content + " More.", metadata=chunk.metadata)
    other_floor = NuggetCompressor(model=compressor.model, store=compressor.store, keep_ratio=2,
                                   trust_metadata_keys=True)
    for compressor_step, doc in [(trusting, edited), (other_floor, chunk)]:
        out = compressor_step.invoke([doc])[0].metadata[METADATA_KEY]
        assert out["key"] == compressor.store.key(doc.page_content, compressor_step.fingerprint) != \
            chunk.metadata[METADATA_KEY]["key"]
    assert compressor.invoke([chunk])[0].metadata == chunk.metadata and compressor.store.counted()  # made sure of


def test_planning_takes_the_lengths_the_metadata_names_else_tokenises(index):
    compressor = index.compressor
    chunks = index.documents
    tokenized = [len(compressor.model.tokenizer(d.page_content, add_special_tokens=False)["input_ids"])
                 for d in chunks]
    assert compressor.token_counts(chunks) == tokenized == compressor.token_counts([d.page_content for d in chunks])
    lying = Document(page_content=chunks[0].page_content, metadata={METADATA_KEY: {
        **chunks[0].metadata[METADATA_KEY], "n_tokens": 999}})
    assert compressor.token_counts([lying]) == [999]  # read from the metadata, not tokenised again
    moved = Document(page_content="Another text.", metadata=lying.metadata)
    assert compressor.token_counts([moved]) == [len("Another text.")]  # its key names another text: tokenised

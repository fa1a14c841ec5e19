"""NuggetCompressor and NuggetLLM as LangChain components, on the tiny model."""

import asyncio

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_tests.unit_tests import ChatModelUnitTests
from tiny import tiny_base

from nugget_rag import NuggetCompressor, NuggetConfig, NuggetLLM, NuggetModel, NuggetStore
from nugget_rag.compressor import METADATA_KEY

TEXTS = ["Paris is the capital of France.", "Berlin is the capital of Germany, on the Spree."]


@pytest.fixture(scope="module")
def compressor():
    model = NuggetModel(tiny_base(), NuggetConfig(ratio=4, scorer_layer=2, lora={"rank": 4}))
    return NuggetCompressor(model=model)


def test_compressor_returns_new_documents_naming_stored_nuggets(compressor):
    docs = [Document(page_content=TEXTS[0], metadata={"source": "fr.txt"}), TEXTS[1]]
    out = compressor.invoke(docs)
    assert [d.page_content for d in out] == TEXTS
    assert docs[0].metadata == {"source": "fr.txt"}  # the caller's document is untouched
    assert out[0].metadata["source"] == "fr.txt"
    info = out[0].metadata[METADATA_KEY]
    state = compressor.store.get_by_key(info["key"])
    assert state is not None and state.k == info["n_nuggets"] and state.n == info["n_tokens"]
    assert info["ratio"] == 4.0
    assert info["n_nuggets"] == -(-info["n_tokens"] // 4)


def test_second_compression_runs_no_model_pass(compressor, monkeypatch):
    compressor.invoke(TEXTS)
    monkeypatch.setattr(compressor.model, "compress", lambda *a, **k: pytest.fail("model ran on a cached text"))
    assert len(compressor.invoke(list(reversed(TEXTS)))) == 2


def test_another_fingerprint_misses(compressor):
    other = NuggetCompressor(model=compressor.model, store=compressor.store, ratio=2)
    misses = compressor.store.stats["misses"]
    out = other.invoke(TEXTS[0])
    assert compressor.store.stats["misses"] == misses + 1
    assert out[0].metadata[METADATA_KEY]["ratio"] == 2.0


def test_empty_documents_are_dropped_and_wrong_types_rejected(compressor, caplog):
    out = compressor.invoke([TEXTS[0], "   \n", Document(page_content="")])
    assert [d.page_content for d in out] == [TEXTS[0]]
    assert "empty or whitespace" in caplog.text
    with pytest.raises(TypeError, match="item 1 is a int"):
        compressor.invoke([TEXTS[0], 42])
    with pytest.raises(ValueError, match="ratio"):
        NuggetCompressor(model=compressor.model, ratio=0)


def test_batch_and_async_match_invoke(compressor):
    expected = compressor.invoke(TEXTS)
    batched = compressor.batch([TEXTS[:1], TEXTS])
    assert batched[0] == expected[:1] and batched[1] == expected
    assert asyncio.run(compressor.ainvoke(TEXTS)) == expected
    assert compressor.compress_documents([Document(page_content=t) for t in TEXTS], "query") == expected


def test_documents_from_a_persistent_store_survive_a_restart(compressor, tmp_path):
    first = NuggetCompressor(model=compressor.model, store=NuggetStore(directory=tmp_path))
    key = first.invoke(TEXTS[0])[0].metadata[METADATA_KEY]["key"]
    reopened = NuggetStore(directory=tmp_path)
    state = reopened.get_by_key(key)
    assert state is not None and state.fingerprint == compressor.model.fingerprint()


class Tokens(BaseCallbackHandler):
    def __init__(self):
        self.tokens = []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)


def test_llm_reads_compressed_documents_in_a_chain(compressor):
    llm = NuggetLLM(compressor=compressor, max_new_tokens=6)
    retriever = RunnableLambda(lambda question: [Document(page_content=t, metadata={"source": i}) for i, t in enumerate(TEXTS)])
    chain = {"documents": retriever | compressor, "question": RunnablePassthrough()} | llm
    handler = Tokens()
    message = chain.invoke("Which capital?", {"callbacks": [handler]})
    assert message.response_metadata["sources"] == [{"source": 0}, {"source": 1}]
    assert message.response_metadata["n_nuggets"] == sum(-(-len(t) // 4) for t in TEXTS)
    assert "".join(handler.tokens) == message.content
    streamed = "".join(chunk for chunk in (chain | StrOutputParser()).stream("Which capital?"))
    assert streamed == message.content


def test_documents_change_the_answer_and_order_is_deterministic(compressor):
    llm = NuggetLLM(compressor=compressor, max_new_tokens=5)
    question = "Which capital?"
    with_docs = llm.invoke({"documents": TEXTS, "question": question})
    again = llm.invoke({"documents": TEXTS, "question": question})
    assert with_docs.content == again.content
    assert llm.invoke(question).response_metadata["n_documents"] == 0
    bound = llm.bind(documents=TEXTS).invoke(question)
    assert bound.content == with_docs.content


def test_streaming_equals_invoke_and_async(compressor):
    llm = NuggetLLM(compressor=compressor, max_new_tokens=7)
    request = {"documents": TEXTS, "question": "Where?"}
    text = llm.invoke(request).content
    assert "".join(c.content for c in llm.stream(request)) == text

    async def collect():
        return "".join([c.content async for c in llm.astream(request)]), (await llm.ainvoke(request)).content

    assert asyncio.run(collect()) == (text, text)


def test_stop_strings_cut_the_answer(compressor):
    llm = NuggetLLM(compressor=compressor, max_new_tokens=12, temperature=1.0, seed=3)
    text = llm.invoke({"documents": TEXTS, "question": "Where?"}).content
    assert len(text) > 2
    stop = text[1:3]
    cut = llm.invoke({"documents": TEXTS, "question": "Where?"}, stop=[stop]).content
    assert cut == text[: text.find(stop)]


def test_repetition_settings_reach_generation(compressor):
    request = {"documents": TEXTS, "question": "Where?"}
    plain = NuggetLLM(compressor=compressor, max_new_tokens=30).invoke(request).content
    pairs = [plain[i : i + 2] for i in range(len(plain) - 1)]
    assert len(set(pairs)) < len(pairs)  # the random tiny model repeats itself
    for llm, call in [(NuggetLLM(compressor=compressor, max_new_tokens=30, no_repeat_ngram_size=2), {}),
                      (NuggetLLM(compressor=compressor, max_new_tokens=30), {"no_repeat_ngram_size": 2})]:
        text = llm.invoke(request, **call).content
        pairs = [text[i : i + 2] for i in range(len(text) - 1)]
        assert len(set(pairs)) == len(pairs)


def test_bad_llm_input(compressor):
    llm = NuggetLLM(compressor=compressor)
    with pytest.raises(ValueError, match="question"):
        llm.invoke({"documents": TEXTS})
    with pytest.raises(ValueError, match="positions"):
        llm.invoke({"documents": TEXTS, "question": "x" * 600})


@pytest.fixture(scope="module")
def standard_params():
    model = NuggetModel(tiny_base(), NuggetConfig(ratio=4, scorer_layer=2, lora={"rank": 4}))
    return {"compressor": NuggetCompressor(model=model), "max_new_tokens": 4}


class TestNuggetLLMStandard(ChatModelUnitTests):
    """LangChain's standard unit tests for chat models (no tool calling or structured output)."""

    @pytest.fixture(autouse=True)
    def _params(self, standard_params):
        self._standard = standard_params

    @property
    def chat_model_class(self):
        return NuggetLLM

    @property
    def chat_model_params(self):
        return self._standard

    @property
    def has_tool_calling(self):
        return False

    @property
    def has_structured_output(self):
        return False


def test_llm_reads_the_nuggets_inside_the_last_user_turn(compressor):
    from nugget_rag.generation import GenerationSettings, generate
    from nugget_rag.prompts import QA_PROMPT

    llm = NuggetLLM(compressor=compressor, max_new_tokens=6, system_prompt="Be brief.")
    model = compressor.model
    answer = llm.invoke({"documents": TEXTS, "question": "Which capital?"}).content
    before, after = model.chat_prompt([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": QA_PROMPT.format(question="Which capital?")}])
    assert model.tokenizer.decode(before) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    states = compressor.states(TEXTS)
    assert answer == generate(model, [states], [after], GenerationSettings(max_new_tokens=6), prefixes=[before])[0]

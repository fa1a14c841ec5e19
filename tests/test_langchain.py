"""NuggetCompressor and NuggetLLM as LangChain components, on the tiny model."""

import asyncio
from pathlib import Path

import pytest
import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_tests.unit_tests import ChatModelUnitTests
from standard import NuggetLLMSuite
from tiny import tiny_base, tiny_nugget_model

from nugget_rag import NuggetCompressor, NuggetLLM, NuggetStore
from nugget_rag.components.compressor import METADATA_KEY
from nugget_rag.components.llm import chat_dicts
from nugget_rag.generation import GenerationSettings
from nugget_rag.prompts import SUMMARY_PROMPT

TEXTS = ["Paris is the capital of France.", "Berlin is the capital of Germany, on the Spree."]


@pytest.fixture(scope="module")
def compressor():
    model = tiny_nugget_model()
    return NuggetCompressor(model=model)


def test_compressor_returns_new_documents_naming_stored_nuggets(compressor):
    docs = [Document(page_content=TEXTS[0], metadata={"source": "fr.txt"}), TEXTS[1]]
    out = compressor.invoke(docs)
    assert [d.page_content for d in out] == TEXTS
    assert docs[0].metadata == {"source": "fr.txt"}  # the caller's document is untouched
    assert out[0].metadata["source"] == "fr.txt"
    info = out[0].metadata[METADATA_KEY]
    state = compressor.store.get_by_key(info["key"])
    assert state is not None and state.at_ratio(info["ratio"]).k == info["n_nuggets"] and state.n == info["n_tokens"]
    assert info["ratio"] == 4.0 and info["floor"] == state.floor == 4.0  # the default floor: the probe's ratio
    assert info["n_nuggets"] == -(-info["n_tokens"] // 4)


def test_second_compression_runs_no_model_pass(compressor, monkeypatch):
    compressor.invoke(TEXTS)
    monkeypatch.setattr(compressor.model, "compress", lambda *a, **k: pytest.fail("model ran on a cached text"))
    assert len(compressor.invoke(list(reversed(TEXTS)))) == 2


def test_another_ratio_reads_the_stored_state_and_another_floor_misses(compressor, monkeypatch):
    compressor.invoke(TEXTS[0])
    coarser = NuggetCompressor(model=compressor.model, store=compressor.store, ratio=8)
    with monkeypatch.context() as patch:
        patch.setattr(compressor.model, "compress", lambda *a, **k: pytest.fail("recomputed a stored state"))
        out = coarser.invoke(TEXTS[0])
    assert out[0].metadata[METADATA_KEY]["ratio"] == 8.0
    assert out[0].metadata[METADATA_KEY]["n_nuggets"] == -(-out[0].metadata[METADATA_KEY]["n_tokens"] // 8)
    coarse_floor = NuggetCompressor(model=compressor.model, store=compressor.store, keep_ratio=2)
    assert coarse_floor.fingerprint != compressor.fingerprint
    misses = compressor.store.stats["misses"]
    coarse_floor.invoke(TEXTS[0])
    assert compressor.store.stats["misses"] > misses


def test_compressors_splitting_documents_differently_keep_apart_in_one_store(compressor, monkeypatch):
    long_text = " ".join(TEXTS * 4)
    segmented = NuggetCompressor(model=compressor.model, store=compressor.store, segment_tokens=10)
    cut, whole = segmented.states([long_text])[0], compressor.states([long_text])[0]
    assert cut.fingerprint == segmented.fingerprint != whole.fingerprint == compressor.fingerprint
    assert cut.positions.tolist() != whole.positions.tolist()
    monkeypatch.setattr(compressor.model, "compress", lambda *a, **k: pytest.fail("model ran on a cached text"))
    assert segmented.states([long_text])[0].positions.tolist() == cut.positions.tolist()  # a hit, not a recompute


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
    assert state is not None and state.fingerprint == compressor.fingerprint


class Tokens(BaseCallbackHandler):
    def __init__(self):
        self.tokens = []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)


def test_llm_reads_compressed_documents_in_a_chain(compressor):
    llm = NuggetLLM(compressor=compressor, max_new_tokens=6, resolution="uniform")
    retriever = RunnableLambda(lambda question: [Document(page_content=t, metadata={"source": i}) for i, t in enumerate(TEXTS)])
    chain = {"documents": retriever | compressor, "question": RunnablePassthrough()} | llm
    handler = Tokens()
    message = chain.invoke("Which capital?", {"callbacks": [handler]})
    assert message.response_metadata["sources"] == [{"index": 0, "read_as": "nuggets", "source": 0},
                                                    {"index": 1, "read_as": "nuggets", "source": 1}]
    assert message.response_metadata["n_nuggets"] == sum(-(-len(t) // 4) for t in TEXTS)
    assert message.response_metadata["n_document_tokens"] == sum(len(t) for t in TEXTS)
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
    plain = NuggetLLM(compressor=compressor, max_new_tokens=30, no_repeat_ngram_size=0).invoke(request).content
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
    model = tiny_nugget_model()
    return {"compressor": NuggetCompressor(model=model), "max_new_tokens": 4}


class TestNuggetLLMStandard(NuggetLLMSuite, ChatModelUnitTests):
    """LangChain's standard unit tests for chat models (no tool calling or structured output)."""

    @pytest.fixture(autouse=True)
    def _params(self, standard_params):
        self.params = standard_params


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


class Ends(BaseCallbackHandler):
    def __init__(self):
        self.outputs = []

    def on_chain_end(self, outputs, **kwargs):
        self.outputs.append(outputs)


def test_batch_compresses_once_even_when_the_store_memory_evicts(compressor, monkeypatch):
    small = NuggetCompressor(model=compressor.model, store=NuggetStore(max_memory_bytes=1))  # keeps nothing
    calls = []
    compress = compressor.model.compress
    monkeypatch.setattr(compressor.model, "compress", lambda ids, **k: calls.append(len(ids)) or compress(ids, **k))
    texts = ["Rome is in Italy.", "Madrid is in Spain.", "Oslo is in Norway."]
    out = small.batch([texts[:1], texts[1:]])
    assert calls == [3]
    assert [[d.page_content for d in docs] for docs in out] == [texts[:1], texts[1:]]


def test_batch_keeps_the_runnable_contract_in_one_model_pass(compressor, monkeypatch):
    texts = ["Rome is in Italy.", "Madrid is in Spain.", "Oslo is in Norway."]
    calls = []
    compress = compressor.model.compress
    monkeypatch.setattr(compressor.model, "compress", lambda ids, **k: calls.append(len(ids)) or compress(ids, **k))
    handlers = [Ends(), Ends(), Ends()]
    out = compressor.batch([texts[:1], [texts[1], 123], texts[1:]], [{"callbacks": [h]} for h in handlers],
                           return_exceptions=True)
    assert calls == [3]  # the valid inputs' documents, compressed together
    assert [d.page_content for d in out[0]] == texts[:1] and [d.page_content for d in out[2]] == texts[1:]
    assert isinstance(out[1], TypeError) and "item 1 is a int" in str(out[1])
    assert handlers[0].outputs == [out[0]] and handlers[2].outputs == [out[2]] and handlers[1].outputs == []
    with pytest.raises(TypeError, match="item 1 is a int"):
        compressor.batch([["ok"], ["ok", 123]])


def test_documents_that_are_all_empty_or_unknown_keys_are_errors(compressor):
    llm = NuggetLLM(compressor=compressor, max_new_tokens=3)
    with pytest.raises(ValueError, match="all 2 documents given are empty or whitespace"):
        llm.invoke({"documents": ["  ", Document(page_content="\n")], "question": "Where?"})
    with pytest.raises(ValueError, match="all 1 documents"):
        llm.invoke("Where?", documents=[" "])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['context'\].*'documents'"):
        llm.invoke({"context": TEXTS, "question": "Where?"})
    assert llm.invoke({"documents": [], "question": "Where?"}).response_metadata["n_documents"] == 0


def test_documents_carried_in_a_message_may_be_strings(compressor):
    from langchain_core.messages import HumanMessage

    llm = NuggetLLM(compressor=compressor, max_new_tokens=5)
    carried = llm.invoke([HumanMessage("Where?", additional_kwargs={"documents": TEXTS})])
    assert len(carried.response_metadata["resolution"]) == 2  # both planned (the default reads the likelier one)
    assert carried.content == llm.invoke({"documents": TEXTS, "question": "Where?"}).content


def test_prompt_template_fills_only_the_question(compressor):
    with pytest.raises(ValueError, match=r"\['context'\], but only \{question\} is filled"):
        NuggetLLM(compressor=compressor, prompt_template="{context}\n{question}")
    fixed = NuggetLLM(compressor=compressor, prompt_template="Summarize the document.", max_new_tokens=3)
    assert fixed.invoke({"documents": TEXTS, "question": ""}).response_metadata["n_documents"] == 2
    with pytest.raises(ValueError, match="no {question} placeholder, so the question 'Where.' would be dropped"):
        fixed.invoke({"documents": TEXTS, "question": "Where?"})
    llm = NuggetLLM(compressor=compressor, prompt_template="{{Q}}: {question}", max_new_tokens=3)
    assert len(llm.invoke({"documents": TEXTS, "question": "Where?"}).response_metadata["resolution"]) == 2


def test_summary_example_rejects_a_whitespace_file(compressor, tmp_path, monkeypatch, capsys):
    import runpy
    import sys

    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\t\n", encoding="utf-8")
    example = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "summarize_long_document.py"))
    monkeypatch.setitem(example["main"].__globals__, "load_compressor", lambda *a, **k: compressor)
    monkeypatch.setattr(sys, "argv", ["summarize_long_document.py", str(blank)])
    assert example["main"]() == 2
    captured = capsys.readouterr()
    assert "is empty or whitespace" in captured.err and "Summary" not in captured.out


def test_an_empty_question_is_refused_unless_the_template_takes_none(compressor):
    llm = NuggetLLM(compressor=compressor, max_new_tokens=3)
    for call in (lambda: llm.invoke(""), lambda: llm.invoke({"documents": TEXTS, "question": "  "}),
                 lambda: llm.invoke(" ", documents=TEXTS)):
        with pytest.raises(ValueError, match="the question is empty.*SUMMARY_PROMPT"):
            call()
    summary = NuggetLLM(compressor=compressor, max_new_tokens=3, prompt_template=SUMMARY_PROMPT)
    assert summary.invoke({"documents": TEXTS, "question": ""}).response_metadata["n_documents"] == 2


@pytest.mark.parametrize("setting", ["temperature", "repetition_penalty"])
def test_non_finite_generation_settings_are_refused(compressor, setting):
    for value in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite"):
            NuggetLLM(compressor=compressor, **{setting: value})
        with pytest.raises(ValueError, match="finite"):
            GenerationSettings(**{setting: value})


def test_usage_metadata_counts_prompt_and_nuggets_and_cache_reads():
    model = tiny_nugget_model()
    llm = NuggetLLM(compressor=NuggetCompressor(model=model), max_new_tokens=5, finish_sentence=0,
                   resolution="uniform")
    request = {"documents": TEXTS, "question": "Which capital?"}
    k = sum(-(-len(t) // 4) for t in TEXTS)
    first = llm.invoke(request).usage_metadata
    messages = llm._convert_input(request).to_messages()
    prefix, prompt = llm._prompt_ids(chat_dicts(messages, None), with_documents=True)
    assert first["input_tokens"] == len(prefix) + len(prompt) + k
    assert 1 <= first["output_tokens"] <= 5
    assert first["total_tokens"] == first["input_tokens"] + first["output_tokens"]
    assert first["input_token_details"] == {"cache_read": 0, "cache_creation": k}
    again = llm.invoke(request).usage_metadata
    assert again["input_token_details"] == {"cache_read": k, "cache_creation": 0}
    chunks = list(llm.stream(request))
    assert sum(1 for c in chunks if c.usage_metadata) == 1  # input tokens are counted once
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert streamed.usage_metadata == again
    meta = streamed.response_metadata
    assert meta["compression_ratio"] == pytest.approx(meta["n_document_tokens"] / meta["n_nuggets"])


def test_sources_name_each_document_by_its_index_among_those_given(compressor):
    llm = NuggetLLM(compressor=compressor, max_new_tokens=2, resolution="uniform")
    docs = ["  ", Document(page_content=TEXTS[0], id="fr"), TEXTS[1]]
    sources = llm.invoke({"documents": docs, "question": "Which capital?"}).response_metadata["sources"]
    assert sources == [{"index": 1, "id": "fr", "read_as": "nuggets"}, {"index": 2, "read_as": "nuggets"}]


def test_from_pretrained_takes_every_compressor_field_and_a_byte_store(tmp_path):
    from langchain_core.stores import InMemoryByteStore

    shared = InMemoryByteStore()
    compressor = NuggetCompressor.from_pretrained(None, base_model=tiny_base(), store=shared, ratio=2, batch_size=3)
    assert compressor.store.byte_store is shared and compressor.ratio == 2 and compressor.batch_size == 3
    store = NuggetStore()
    assert NuggetCompressor.from_pretrained(None, base_model=tiny_base(), store=store).store is store
    with pytest.raises(TypeError, match="store is a dict"):
        NuggetCompressor.from_pretrained(None, base_model=tiny_base(), store={})
    with pytest.raises(ValueError, match="pass one"):
        NuggetCompressor.from_pretrained(None, base_model=tiny_base(), store=store, store_dir=tmp_path)


@pytest.mark.parametrize("kv_format", ["bfloat16", "int8", "int4"])
def test_compressor_uses_states_exactly_as_the_store_gives_them_back(tmp_path, kv_format):
    model = tiny_nugget_model()
    fresh = NuggetCompressor(model=model, store=NuggetStore(directory=tmp_path), kv_format=kv_format).states(TEXTS)
    again = NuggetCompressor(model=model, store=NuggetStore(directory=tmp_path), kv_format=kv_format).states(TEXTS)
    for a, b in zip(fresh, again):
        assert a.kv_format == b.kv_format == kv_format
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert NuggetCompressor(model=model).kv_format == "bfloat16"

"""One stored state, any resolution: ranked states, per-document ratios and the resolution policies."""

import inspect
import math

import pytest
import torch

from nugget_rag.state import CorruptStateError, NuggetState

DOC = "The quick brown fox jumps over the lazy dog, then naps."
DOC2 = "Paris is the capital of France, and Berlin is the capital of Germany."


@pytest.mark.parametrize("ratio", [1, 2, 3.5, 10, 100])
def test_a_ranked_state_read_at_r_equals_the_document_compressed_at_r(make_model, doc_ids, ratio):
    model = make_model()
    docs = [doc_ids(DOC), doc_ids(DOC2)]
    with torch.no_grad():
        ranked = model.compress(docs, ratio=1, ranked=True)
        direct = model.compress(docs, ratio=ratio)
    for state, want in zip(ranked, direct):
        assert state.ranked and state.floor == 1 and state.k == state.n
        read = state.at_ratio(ratio)
        assert read.positions.tolist() == want.positions.tolist()
        assert read.tokens == want.tokens and read.k == state.count_at(ratio) == math.ceil(state.n / ratio)
        torch.testing.assert_close(read.keys, want.keys, rtol=0, atol=0)
        torch.testing.assert_close(read.values, want.values, rtol=0, atol=0)
        torch.testing.assert_close(read.scores, want.scores, rtol=0, atol=0)
        assert not read.ranked


def test_resolution_order_is_nested_with_the_last_token_first(make_model, doc_ids):
    model = make_model()
    ids = doc_ids(DOC)
    with torch.no_grad():
        state = model.compress([ids], ratio=2, ranked=True)[0]
    assert state.positions[0] == state.n - 1
    assert state.k == math.ceil(state.n / 2)
    for coarse, fine in [(10, 5), (5, 3), (3, 2)]:
        assert set(state.at_ratio(coarse).positions.tolist()) <= set(state.at_ratio(fine).positions.tolist())
    rest = state.scores[1:]
    assert (rest[:-1] >= rest[1:]).all()  # after the last token: by descending score


def test_segmented_ranked_states_read_each_segment_at_r(make_model, doc_ids):
    model = make_model()
    ids = doc_ids(DOC + " " + DOC2)
    with torch.no_grad():
        ranked = model.compress([ids], ratio=1, segment_tokens=20, ranked=True)[0]
        direct = model.compress([ids], ratio=4, segment_tokens=20)[0]
    assert ranked.segments == tuple(len(ids[i : i + 20]) for i in range(0, len(ids), 20))
    read = ranked.at_ratio(4)
    assert read.positions.tolist() == direct.positions.tolist()
    torch.testing.assert_close(read.keys, direct.keys, rtol=0, atol=0)


def test_a_ratio_below_the_floor_is_refused_never_read_short(make_model, doc_ids):
    model = make_model()
    with torch.no_grad():
        state = model.compress([doc_ids(DOC)], ratio=5, ranked=True)[0]
    with pytest.raises(ValueError, match="ratio 2 is finer than this state's floor 5"):
        state.at_ratio(2)
    with torch.no_grad():
        plain = model.compress([doc_ids(DOC)], ratio=5)[0]
    with pytest.raises(ValueError, match="reading order"):
        plain.at_ratio(5)


@pytest.mark.parametrize("kv_format", ["float32", "bfloat16", "int8", "int4"])
def test_ranked_states_round_trip_through_bytes(make_model, doc_ids, kv_format):
    model = make_model()
    with torch.no_grad():
        state = model.compress([doc_ids(DOC)], ratio=1, segment_tokens=30, ranked=True)[0].compact(kv_format)
    back = NuggetState.from_bytes(state.to_bytes())
    assert back.floor == 1 and back.segments == state.segments
    assert back.at_ratio(4).positions.tolist() == state.at_ratio(4).positions.tolist()
    torch.testing.assert_close(back.at_ratio(4).keys.float(), state.at_ratio(4).keys.float())


def test_ranked_state_whose_floor_does_not_fit_its_nuggets_is_corrupt(make_model, doc_ids):
    model = make_model()
    with torch.no_grad():
        state = model.compress([doc_ids(DOC)], ratio=2, ranked=True)[0]
    state.floor = 1.0  # claims every token, holds half
    with pytest.raises(CorruptStateError, match="floor 1.0"):
        NuggetState.from_bytes(state.to_bytes())


def test_ranked_and_reading_order_states_have_different_fingerprints(make_model):
    model = make_model()
    assert model.fingerprint(1.0, ranked=True) != model.fingerprint(1.0)


# ---------------------------------------------------------------------------------------------- policies
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import HumanMessage  # noqa: E402
from tiny import tiny_base  # noqa: E402

from nugget_rag import NuggetCompressor, NuggetLLM  # noqa: E402
from nugget_rag.components.llm import chat_dicts  # noqa: E402
from nugget_rag.components.resolution import (  # noqa: E402
    LexicalRerank,
    PlanCompressor,
    QueryLikelihood,
    ResolutionPolicy,
    RetrieverRank,
    UniformResolution,
    resolve_policy,
)
from nugget_rag.config import DECODER, ENCODER  # noqa: E402
from nugget_rag.generation import GenerationSettings, generate  # noqa: E402

TEXTS = [DOC, DOC2, "Rivers run to the sea over stones and sand.", "Bees make honey from the nectar of flowers."]
QUESTION = "What is the capital of France?"


@pytest.fixture
def compressor(make_model):
    return NuggetCompressor(model=make_model(), kv_format="float32")


def test_the_compressor_meets_the_plans_protocol(compressor):
    """The plan reaches states and the model only through PlanCompressor; NuggetCompressor has each of its members,
    with the same parameters."""
    assert isinstance(compressor, PlanCompressor)
    members = [name for name in vars(PlanCompressor) if not name.startswith("_")]
    assert set(members) == {"effective_ratio", "token_counts", "reading", "states", "lookup", "question_likelihoods"}
    for name in members:
        wanted = getattr(PlanCompressor, name)
        if isinstance(wanted, property):
            assert isinstance(getattr(NuggetCompressor, name), property)
        else:
            assert list(inspect.signature(getattr(NuggetCompressor, name)).parameters) == \
                list(inspect.signature(wanted).parameters), name


@pytest.mark.parametrize("policy", [
    RetrieverRank(), RetrieverRank(budget=0.1), RetrieverRank(expand=2, skim_ratio=4, budget=0.6),
    RetrieverRank(skim_ratio=10, budget=0.05), LexicalRerank(skim_ratio=5), QueryLikelihood(budget=0.2),
    QueryLikelihood(probe_reading="text", probe_ratio=1, skim_ratio=8), UniformResolution(skim_ratio=3),
    UniformResolution(skim_ratio=2, budget=0.3),
])
def test_every_policy_keeps_within_its_budget(compressor, policy):
    lengths = [len(compressor.model.tokenizer(t)["input_ids"]) for t in TEXTS]
    readings = policy.plan(QUESTION, TEXTS, compressor)
    whole = sum(r.positions for r in readings if r.ratio == 1)
    skims = sum(r.positions for r in readings if r.ratio not in (None, 1))
    assert skims == 0 or whole + skims <= policy.positions_budget(lengths)  # skims take what the whole ones leave
    states = [compressor.states([t], r.ratio, r.adapter)[0] for t, r in zip(TEXTS, readings) if r.ratio]
    assert [s.k for s in states] == [r.positions for r in readings if r.ratio]
    assert any(r.ratio for r in readings) and all(r.reason for r in readings)


def test_rank_reads_the_top_document_whole_and_drops_or_skims_the_rest(compressor):
    dropped = RetrieverRank(budget=0.5).plan(QUESTION, TEXTS, compressor)
    assert [r.ratio for r in dropped] == [1.0, None, None, None] and dropped[0].adapter is None
    assert "read whole" in dropped[0].reason and "dropped" in dropped[1].reason
    skimmed = RetrieverRank(budget=0.5, skim_ratio=10).plan(QUESTION, TEXTS, compressor)
    assert [r.ratio for r in skimmed] == [1.0, 10.0, 10.0, 10.0] and skimmed[1].adapter == ENCODER
    assert RetrieverRank().decoder_adapter(dropped) is None and RetrieverRank().decoder_adapter(skimmed) == DECODER


def test_the_top_document_is_read_whole_before_any_other_is_skimmed(compressor):
    lengths = [len(compressor.model.tokenizer(t)["input_ids"]) for t in TEXTS]
    budget = lengths[0] + 2  # the first passage whole leaves room for two one-position skims, not three
    policy = RetrieverRank(skim_ratio=100, budget=(budget + 0.5) / sum(lengths))
    readings = policy.plan(QUESTION, TEXTS, compressor)
    assert [r.ratio for r in readings] == [1.0, 100.0, 100.0, None]  # the least relevant skim is dropped
    assert sum(r.positions for r in readings) <= policy.positions_budget(lengths)


def test_a_document_longer_than_the_budget_is_still_read_whole_as_text(compressor):
    readings = RetrieverRank(budget=0.1, skim_ratio=10).plan(QUESTION, TEXTS, compressor)
    assert [r.ratio for r in readings] == [1.0, None, None, None] and readings[0].adapter is None
    assert "read whole as text" in readings[0].reason and "budget holds no more" in readings[1].reason


@pytest.mark.parametrize("texts", [[DOC2], [DOC2 * 3, TEXTS[2]]], ids=["k=1", "k=2, long top passage"])
def test_the_default_reads_the_top_passage_as_text_and_says_so(compressor, texts):
    """NuggetLLM's own default is the chain's: the top passage whole as text, whatever its share of the budget."""
    meta = NuggetLLM(compressor=compressor, max_new_tokens=2).invoke({"documents": texts, "question": QUESTION}
                                                                     ).response_metadata
    assert meta["resolution_policy"] == "QueryLikelihood"
    top = max(meta["resolution"], key=lambda r: r["relevance"])
    assert top["ratio"] == 1.0 and top["read_as"] == "text" and "read whole as text" in top["reason"]
    assert top["index"] in [s["index"] for s in meta["sources"]]
    assert all(s["read_as"] == "text" for s in meta["sources"])  # and a second passage only if about as likely
    assert meta["n_nuggets"] == 0 and meta["n_text_tokens"] == meta["n_document_tokens"] >= top["positions"]
    assert meta["compression_ratio"] == 1.0


def test_nugget_llm_alone_reads_four_passages_as_the_chain_does(compressor):
    from langchain_core.runnables import RunnableLambda

    from nugget_rag.integrations import build_qa_chain

    docs = [Document(page_content=t, metadata={"source": f"d{i}"}) for i, t in enumerate(TEXTS)]
    alone = NuggetLLM(compressor=compressor, max_new_tokens=4).invoke({"documents": docs, "question": QUESTION})
    chained = build_qa_chain(RunnableLambda(lambda _: docs), NuggetLLM(compressor=compressor, max_new_tokens=4)
                             ).invoke(QUESTION)
    assert alone.response_metadata["resolution"] == chained.response_metadata["resolution"]
    assert alone.content == chained.content
    assert [r["read_as"] for r in alone.response_metadata["resolution"]].count("text") in (1, 2)


def test_a_summary_keeps_the_compressed_reading(compressor):
    from nugget_rag.prompts import SUMMARY_PROMPT

    summary = NuggetLLM(compressor=compressor, max_new_tokens=2, prompt_template=SUMMARY_PROMPT)
    meta = summary.invoke({"documents": TEXTS[:2], "question": ""}).response_metadata
    assert meta["resolution_policy"] == "UniformResolution"
    assert [r["ratio"] for r in meta["resolution"]] == [compressor.effective_ratio] * 2
    assert [s["read_as"] for s in meta["sources"]] == ["nuggets", "nuggets"]


@pytest.mark.parametrize("scores, margin, most, whole", [
    ([-1.0, -1.2, -3.0, -1.25], None, 2, [0]), ([-1.0, -1.2, -3.0, -1.25], 0.1, 2, [0]),
    ([-1.0, -1.2, -3.0, -1.25], 0.2, 2, [0, 1]), ([-1.0, -1.2, -3.0, -1.25], 0.3, 2, [0, 1]),
    ([-1.0, -1.2, -3.0, -1.25], 0.3, 3, [0, 1, 3]), ([-2.0], 5.0, 2, [0]),
])
def test_expand_margin_reads_the_next_passages_whole_when_about_as_relevant(scores, margin, most, whole):
    policy = RetrieverRank(expand_margin=margin, expand_max=most)
    readings = policy.allocate(scores, [50] * len(scores))
    assert [i for i, r in enumerate(readings) if r.ratio == 1.0] == whole
    assert all(r.ratio is None for i, r in enumerate(readings) if i not in whole)


def test_lexical_rerank_puts_the_matching_document_first(compressor):
    readings = LexicalRerank().plan(QUESTION, TEXTS, compressor)
    assert [r.ratio is not None for r in readings] == [False, True, False, False]


@pytest.mark.parametrize("reading, ratio, adapter, decoder", [("text", 1.0, None, None), ("nuggets", 4.0, ENCODER, DECODER)])
def test_query_likelihood_is_the_questions_log_probability_given_each_reading(compressor, reading, ratio, adapter,
                                                                              decoder):
    model = compressor.model
    scores = QueryLikelihood(probe_reading=reading, probe_ratio=ratio).relevance(QUESTION, TEXTS[:2], compressor)
    state = compressor.states([TEXTS[1]], ratio, adapter=adapter)[0]
    _, after = model.chat_prompt([{"role": "user", "content": "Please write a question about the passage above."}])
    asked = model.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model.decode([[state]], torch.tensor([after + asked]), adapter=decoder).logits[0].float()
    logp = torch.log_softmax(logits[len(after) - 1 : -1], -1)[torch.arange(len(asked)), torch.tensor(asked)]
    assert scores[1] == pytest.approx(logp.mean().item(), abs=1e-4)


def test_bad_budgets_and_empty_inputs_get_clear_errors(compressor):
    with pytest.raises(ValueError, match="holds none of the 4 documents"):
        UniformResolution(skim_ratio=1, max_positions=2).plan(QUESTION, TEXTS, compressor)
    with pytest.raises(ValueError, match="unknown resolution 'best'.*'default'"):
        resolve_policy("best")
    with pytest.raises(ValueError, match="resolution=None is not a reading.*'uniform'"):
        NuggetLLM(compressor=compressor, resolution=None)
    with pytest.raises(ValueError, match="unknown resolution 'best'"):
        NuggetLLM(compressor=compressor, resolution="best")
    with pytest.raises(ValueError):
        RetrieverRank(budget=0)
    with pytest.raises(ValueError, match="got no documents"):
        QueryLikelihood().plan(QUESTION, [], compressor)
    with pytest.raises(ValueError):
        RetrieverRank(skim_ratio=0.5)
    with pytest.raises(ValueError, match="empty one"):
        QueryLikelihood().plan("", TEXTS, compressor)


class _Fails(ResolutionPolicy):
    def relevance(self, question, texts, compressor):
        raise RuntimeError("the reranker is down")


def test_a_failing_policy_fails_the_call_never_a_silent_uniform_reading(compressor):
    llm = NuggetLLM(compressor=compressor, max_new_tokens=3, resolution=_Fails())
    with pytest.raises(RuntimeError, match="reranker is down"):
        llm.invoke({"documents": TEXTS, "question": QUESTION})


def test_nugget_llm_reads_each_document_at_its_planned_ratio(compressor, make_model):
    docs = [Document(page_content=t, metadata={"source": f"d{i}"}) for i, t in enumerate(TEXTS)]
    llm = NuggetLLM(compressor=compressor, max_new_tokens=4, finish_sentence=0,
                    resolution=RetrieverRank(skim_ratio=10, budget=0.6))
    answer = llm.invoke({"documents": docs, "question": QUESTION})
    meta = answer.response_metadata
    assert [r["ratio"] for r in meta["resolution"]] == [1.0, 10.0, 10.0, 10.0]
    assert [r["read_as"] for r in meta["resolution"]] == ["text", "nuggets", "nuggets", "nuggets"]
    assert meta["resolution_policy"] == "RetrieverRank"
    assert meta["n_text_tokens"] == meta["resolution"][0]["positions"]
    assert meta["n_nuggets"] == sum(r["positions"] for r in meta["resolution"][1:])
    # The same as generating from those states directly.
    whole = compressor.states([TEXTS[0]], 1.0, adapter=None)
    skims = compressor.states(TEXTS[1:], 10.0)
    prefix, prompt = llm._prompt_ids(chat_dicts([HumanMessage(QUESTION)], None), with_documents=True)
    want = generate(compressor.model, [whole + skims], [prompt], GenerationSettings(max_new_tokens=4),
                    adapter=DECODER, prefixes=[prefix])[0]
    assert answer.content == want


def test_one_document_read_whole_as_text_is_the_frozen_models_full_reading(compressor):
    from nugget_rag.prompts import chat_token_ids, full_context_messages, render_instruction

    llm = NuggetLLM(compressor=compressor, max_new_tokens=6, resolution=RetrieverRank(budget=1.0))
    answer = llm.invoke({"documents": [TEXTS[1], TEXTS[0]], "question": QUESTION})
    assert [r["ratio"] for r in answer.response_metadata["resolution"]] == [1.0, None]
    assert answer.response_metadata["sources"] == [{"index": 0, "read_as": "text"}]
    model = compressor.model
    ids = chat_token_ids(model.tokenizer, full_context_messages([TEXTS[1]], render_instruction(llm.prompt_template,
                                                                                              QUESTION)))
    with torch.no_grad():
        full = tiny_base().model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                          pad_token_id=model.tokenizer.pad_token_id)
    assert answer.content == model.tokenizer.decode(full[0, len(ids):], skip_special_tokens=True)




def test_text_states_are_stored_beside_the_nuggets_so_no_question_waits(compressor, monkeypatch):
    eager = compressor.model_copy(update={"text_states": True})
    eager.invoke(TEXTS)
    monkeypatch.setattr(compressor.model, "compress", lambda *a, **k: pytest.fail("a question recomputed a state"))
    llm = NuggetLLM(compressor=eager, max_new_tokens=2, resolution=QueryLikelihood(skim_ratio=10))
    answer = llm.invoke({"documents": TEXTS, "question": QUESTION})
    assert answer.usage_metadata["input_token_details"]["cache_creation"] == 0


def test_a_ranked_state_cut_to_a_coarser_floor_reads_the_same(make_model, doc_ids):
    model = make_model()
    with torch.no_grad():
        state = model.compress([doc_ids(DOC + " " + DOC2)], ratio=1, segment_tokens=30, ranked=True)[0]
    cut = state.with_floor(4)
    assert cut.floor == 4 and cut.k == state.count_at(4) < state.k
    assert cut.at_ratio(6).positions.tolist() == state.at_ratio(6).positions.tolist()
    assert NuggetState.from_bytes(cut.to_bytes()).at_ratio(4).tokens == state.at_ratio(4).tokens


def test_states_stored_in_reading_order_by_earlier_versions_keep_working(compressor, monkeypatch, tmp_path):
    import nugget_rag.state.nugget_state as state_module
    from nugget_rag.state.store import NuggetStore

    store = NuggetStore(directory=tmp_path)
    with torch.no_grad():
        legacy = compressor.model.compress([compressor.model.tokenizer(TEXTS[0])["input_ids"]], ratio=4)[0]
    with monkeypatch.context() as patch:
        patch.setattr(state_module, "FORMAT", "nugget-rag/state-v2")
        store.put(TEXTS[0], legacy.compact("bfloat16"))
    reader = NuggetCompressor(model=compressor.model, store=NuggetStore(directory=tmp_path), ratio=4)
    monkeypatch.setattr(compressor.model, "compress", lambda *a, **k: pytest.fail("recomputed a stored state"))
    found = reader.lookup([TEXTS[0]])[0]
    assert found.cached and not found.stored.ranked
    assert found.state.positions.tolist() == legacy.positions.tolist()

"""NuggetSummarizer and build_summary_chain on the tiny model: both readings, the store reused, bad input."""

import pytest
from langchain_core.documents import Document

from nugget_rag import NuggetCompressor, NuggetStore
from nugget_rag.integrations import NuggetSummarizer, build_summary_chain

TEXT = "\n\n".join(f"Paragraph {i}: the cat sat on the mat while dogs ran far away into green hills." for i in range(12))


@pytest.fixture
def summarizer(tiny_model, tmp_path):
    compressor = NuggetCompressor(model=tiny_model, store=NuggetStore(directory=tmp_path / "store"), ratio=4)
    return NuggetSummarizer(compressor=compressor, section_tokens=200, section_max_new_tokens=6, max_new_tokens=8,
                            no_repeat_ngram_size=0)


def test_sections_reading_cuts_batches_and_combines(summarizer):
    answer = summarizer.invoke(TEXT)
    meta = answer.response_metadata
    sections = summarizer.sections([Document(page_content=TEXT)])
    assert meta["reading"] == "sections" and meta["n_sections"] == len(sections) > 1
    assert all(len(summarizer.compressor.model.tokenizer(s.page_content)["input_ids"]) <= 200 for s in sections)
    assert len(meta["section_summaries"]) == len(sections)
    assert meta["n_document_tokens"] == sum(len(summarizer.compressor.model.tokenizer(s.page_content)["input_ids"])
                                            for s in sections)
    assert meta["n_nuggets"] >= meta["n_document_tokens"] / 4
    assert not meta["cached"] and meta["compress_seconds"] >= 0 and meta["decode_seconds"] > 0
    assert answer.usage_metadata["output_tokens"] >= 1


def test_second_summary_reads_the_store_and_matches(summarizer):
    first = summarizer.invoke(TEXT)
    second = summarizer.invoke(TEXT)
    assert second.response_metadata["cached"] and not first.response_metadata["cached"]
    assert second.content == first.content
    assert second.usage_metadata["input_token_details"]["cache_read"] == second.response_metadata["n_nuggets"]


def test_nuggets_reading_reads_every_state_at_once(summarizer):
    reader = summarizer.model_copy(update={"reading": "nuggets"})
    docs = [Document(page_content=TEXT), "A second document about hills."]
    answer = reader.invoke(docs)
    meta = answer.response_metadata
    assert meta["reading"] == "nuggets" and meta["n_sections"] == 2 and "section_summaries" not in meta
    assert meta["compression_ratio"] == pytest.approx(meta["n_document_tokens"] / meta["n_nuggets"])


def test_stream_yields_the_summary_then_metadata(summarizer):
    chunks = list(summarizer.stream(TEXT))
    assert "".join(c.content for c in chunks) == summarizer.invoke(TEXT).content
    assert chunks[-1].response_metadata["reading"] == "sections"


def test_chain_as_text_and_bad_input(summarizer):
    chain = build_summary_chain(summarizer.compressor, as_text=True, section_tokens=200, max_new_tokens=4)
    assert isinstance(chain.invoke(TEXT), str)
    with pytest.raises(ValueError, match="nothing to summarise"):
        summarizer.invoke(["  ", "\n"])
    with pytest.raises(TypeError, match="item 0 is a int"):
        summarizer.invoke([3])
    with pytest.raises(ValueError):
        NuggetSummarizer(compressor=summarizer.compressor, reading="skim")

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


@pytest.mark.parametrize("reading", ["outline", "sections", "nuggets"])
def test_every_reading_reads_the_sections_nuggets(summarizer, reading):
    answer = summarizer.model_copy(update={"reading": reading}).invoke(TEXT)
    meta = answer.response_metadata
    sections = summarizer.sections([Document(page_content=TEXT)])
    assert meta["reading"] == reading and meta["n_sections"] == len(sections) > 1
    assert all(len(summarizer.compressor.model.tokenizer(s.page_content)["input_ids"]) <= 200 for s in sections)
    assert len(meta.get("section_summaries", sections)) == len(sections)
    if reading == "outline":
        assert answer.content == " ".join(s for s in meta["section_summaries"] if s)
    assert meta["n_document_tokens"] == sum(len(summarizer.compressor.model.tokenizer(s.page_content)["input_ids"])
                                            for s in sections)
    assert meta["n_nuggets"] >= meta["n_document_tokens"] / 4
    assert not meta["cached"] and meta["compress_seconds"] >= 0 and meta["decode_seconds"] > 0
    assert answer.usage_metadata["output_tokens"] >= (1 if reading != "outline" else 0)


def test_second_summary_reads_the_store_and_matches(summarizer):
    first = summarizer.invoke(TEXT)
    second = summarizer.invoke(TEXT)
    assert second.response_metadata["cached"] and not first.response_metadata["cached"]
    assert second.content == first.content
    assert second.usage_metadata["input_token_details"]["cache_read"] == second.response_metadata["n_nuggets"]


def test_documents_are_read_as_one_in_order(summarizer):
    reader = summarizer.model_copy(update={"reading": "nuggets"})
    docs = [Document(page_content=TEXT), "A second document about hills."]
    meta = reader.invoke(docs).response_metadata
    assert meta["n_sections"] == len(summarizer.sections([Document(page_content=TEXT)])) + 1
    assert "section_summaries" not in meta
    assert meta["compression_ratio"] == pytest.approx(meta["n_document_tokens"] / meta["n_nuggets"])


def test_stream_yields_the_summary_then_metadata(summarizer):
    chunks = list(summarizer.stream(TEXT))
    assert "".join(c.content for c in chunks) == summarizer.invoke(TEXT).content
    assert chunks[-1].response_metadata["reading"] == "outline"


def test_chain_as_text_and_bad_input(summarizer):
    chain = build_summary_chain(summarizer.compressor, as_text=True, section_tokens=200, max_new_tokens=4)
    assert isinstance(chain.invoke(TEXT), str)
    with pytest.raises(ValueError, match="nothing to summarise"):
        summarizer.invoke(["  ", "\n"])
    with pytest.raises(TypeError, match="item 0 is a int"):
        summarizer.invoke([3])
    with pytest.raises(ValueError):
        NuggetSummarizer(compressor=summarizer.compressor, reading="skim")


def test_many_section_sentences_are_combined_a_group_at_a_time(summarizer):
    """More section sentences than one prompt holds (tiny model: 512 positions) are combined in groups first."""
    sentences = [f"Section {i} tells of cats and dogs in the hills." for i in range(20)]
    assert len(summarizer._combine_prompt(sentences)) > 512
    steps, prompt_tokens = summarizer._combine(sentences)
    assert prompt_tokens <= 512 - summarizer.max_new_tokens
    assert isinstance("".join(steps), str) and steps.finish_reason in ("stop", "length")


def test_cli_summarize_stores_the_nuggets_in_the_index(tiny_cli, tmp_path, capsys):
    from nugget_rag import cli

    path = tiny_cli / "long.txt"
    path.write_text(TEXT)
    index = tmp_path / "index"
    argv = ["summarize", str(path), "--index", str(index), "--max-new-tokens", "4", "--ratio", "4", "--reading", "nuggets"]
    assert cli.main(argv[:2] + argv[4:]) == 0  # no index: compressed in memory
    alone = capsys.readouterr()
    assert "compressed in" in alone.err and alone.out.strip()
    assert cli.main(argv) == 0
    first = capsys.readouterr()
    assert "3 new chunk(s) ingested" in first.err and "all from the store" in first.err
    assert cli.main(argv) == 0
    second = capsys.readouterr()
    assert "0 new chunk(s)" in second.err and "all from the store" in second.err and second.out == first.out
    assert cli.main(["summarize", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err

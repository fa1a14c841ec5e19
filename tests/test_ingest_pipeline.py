"""The one ingest pipeline (integrations/ingest/pipeline.py): its de-duplication, a stop between batches, and a
compress stage run elsewhere through the same functions."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from test_integrations import DOCS, HashEmbeddings
from tiny import tiny_nugget_model

from nugget_rag import NuggetCompressor, NuggetStore
from nugget_rag.cancellation import RequestCancelled
from nugget_rag.integrations import NuggetIndex
from nugget_rag.integrations.ingest.pipeline import compress, embed, ingest, split, unindexed


@pytest.fixture
def index(tmp_path) -> NuggetIndex:
    model = tiny_nugget_model()
    compressor = NuggetCompressor(model=model, store=NuggetStore(directory=tmp_path / "store"))
    return NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=8, batch_size=2)


def test_chunks_already_indexed_or_repeated_in_the_batch_are_added_once(index):
    first = split(index, DOCS[:1])
    assert unindexed(first + first, indexed=set()) == first
    assert ingest(index, DOCS[:1]) == len(first)
    writes = index.compressor.store.stats["writes"]
    added = ingest(index, DOCS + DOCS)  # the first document again, and every document twice
    assert added == len(split(index, DOCS)) - len(first) and len(index) == len(set(index.ids)) == added + len(first)
    assert index.compressor.store.stats["writes"] - writes == added  # each new chunk compressed once
    assert (index.last_ingest["documents"], index.last_ingest["skipped"]) == (6, 2 * len(index) - added)


def test_a_stop_ends_the_ingest_at_its_next_batch_with_every_batch_added_whole(index):
    batches = []
    add_chunks = index.add_chunks

    def counted(docs, vectors):
        batches.append(len(docs))
        add_chunks(docs, vectors)

    index.add_chunks = counted
    with pytest.raises(RequestCancelled):
        ingest(index, DOCS, stop=lambda: len(batches) >= 2)
    assert batches == [2, 2] and len(index) == 4  # two batches of batch_size chunks, then it stopped


def test_a_compress_stage_elsewhere_runs_the_same_stages_and_reports_its_stats(index):
    class Elsewhere:  # as Ray's workers: compress and embed, the batches back in order
        stats: dict = {}

        def __call__(self, target, chunks):
            self.stats = {"workers": 1, "computed": len(chunks)}
            compressed = compress(target.compressor, chunks)
            yield compressed, embed(target.embeddings, compressed)

    added = ingest(index, [Document(page_content="A short note on mills.", metadata={"source": "n"})], stage=Elsewhere())
    assert added == len(index) == 1 and index.last_ingest["workers"] == 1 and index.last_ingest["computed"] == 1
    assert index.documents[0].metadata["nuggets"]["key"] in set(index.compressor.store.byte_store.yield_keys())

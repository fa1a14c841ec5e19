"""The batched token splitter (integrations/ingest/chunking.py) cuts the same chunks as LangChain's splitter measured by the
tokenizer a piece at a time, in far fewer tokenizer calls."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_text_splitters import RecursiveCharacterTextSplitter
from tiny import tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from nugget_rag.integrations.ingest.chunking import split_documents, token_splitter

WORDS = ("the falcon hunts over a river valley while sourdough rises overnight and Jupiter storms rage on "
         "dozens of moons near cliffs").split()
TEXTS = [
    "Short.",  # shorter than any chunk
    "A falcon nests on cliffs.",
    " ".join(WORDS * 6),  # one paragraph of many chunks: the overlap at work
    "\n\n".join(" ".join(WORDS[i : i + 9]) for i in range(0, len(WORDS), 3)),  # paragraphs
    "First line here.\nSecond line, longer than the first.\n\n\n\nAfter blank lines.\n \n  indented  line",
    "supercalifragilistic" * 12 + " then words " + "x" * 90,  # words longer than a chunk: cut by characters
    "Ünïcödé wörds — and emoji 🦅 over the välley. " * 5,
]


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on the texts, merging across spaces: a piece's tokens are not its
    characters, nor the sum of its words'."""
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


class CountingTokenizer:
    """Forwards calls to a tokenizer, counting them."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)


@pytest.fixture(scope="module", params=["characters", "bpe"])
def tokenizer(request):
    return tiny_tokenizer() if request.param == "characters" else bpe_tokenizer()


@pytest.mark.parametrize(("chunk_tokens", "chunk_overlap"), [(8, 0), (16, 4), (24, 8), (64, 8), (384, 32)])
def test_the_same_chunks_as_langchains_splitter(tokenizer, chunk_tokens, chunk_overlap):
    stock = RecursiveCharacterTextSplitter.from_huggingface_tokenizer(tokenizer, chunk_size=chunk_tokens,
                                                                      chunk_overlap=chunk_overlap)
    batched = token_splitter(tokenizer, chunk_tokens, chunk_overlap)
    for text in TEXTS:
        assert batched.split_text(text) == stock.split_text(text)
    docs = [Document(page_content=t, metadata={"source": f"doc-{i}"}) for i, t in enumerate(TEXTS)]
    chunks = split_documents(batched, docs)
    assert chunks == split_documents(stock, docs)  # text, ids, sources, positions
    assert len(chunks) > len(docs) if chunk_tokens < 64 else len(chunks) >= len(docs)


def test_a_passage_of_one_chunk_takes_one_tokenizer_call(tokenizer):
    splitter = token_splitter(tokenizer, 384, 32)
    counting = splitter.tokenizer = CountingTokenizer(tokenizer)
    passage = " ".join(WORDS)
    assert splitter.split_text(passage) == [passage]
    assert counting.calls == 1  # every word of the passage measured at once (LangChain's: twice each, alone)
    splitter.split_text(TEXTS[1])
    assert counting.calls == 2  # a new text measures anew: nothing is kept from one text to the next


def test_a_tokenizer_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match="the tokenizer is a str; give a transformers tokenizer"):
        token_splitter("gpt2", 64, 8)

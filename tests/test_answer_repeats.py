"""Answers that do not loop: the repeat finder, the no-repeat rule in generation, and NuggetLLM's default."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_nugget_model

from nugget_rag import NuggetCompressor, NuggetLLM
from nugget_rag.config import ANSWER_NO_REPEAT_NGRAM_SIZE
from nugget_rag.generation import GenerationSettings, generate
from nugget_rag.generation.repeats import SPACE, NoRepeatPrintedNGram, first_printed_repeat, printed_forms
from nugget_rag.generation.text import first_repeat

TEXTS = ["The falcon hunts over the river valley and dives at great speed.",
         "Sourdough bread needs flour, water, salt and a starter culture."]


@pytest.fixture(scope="module")
def compressor():
    return NuggetCompressor(model=tiny_nugget_model())


def test_first_repeat_finds_the_token_that_completes_a_repeated_ngram():
    assert first_repeat("abcxabcy", 3) == 6 and first_repeat("abcxabcy", 4) is None
    assert first_repeat("aaaa", 1) == 1 and first_repeat("", 8) is None
    with pytest.raises(ValueError, match="n=0"):
        first_repeat("ab", 0)


class WordTokenizer:
    """Just what printed_forms reads of a tokenizer: a vocabulary of whole words, with and without a leading space."""

    VOCAB = ["<eos>", " a", "a", " block", "block", " of", " code", "code", "\n", " runs"]

    def __len__(self) -> int:
        return len(self.VOCAB)

    def batch_decode(self, batch, skip_special_tokens=True):
        return ["".join("" if skip_special_tokens and i == 0 else self.VOCAB[i] for i in ids) for ids in batch]

    def convert_ids_to_tokens(self, ids):
        return [self.VOCAB[i] for i in ids]


def test_the_rule_compares_tokens_by_the_text_they_print():
    """' a' at the start of a line is 'a': the same words after a line break are a repeat, which a rule on token ids
    misses (what the README example's answer printed twice)."""
    tokenizer = WordTokenizer()
    ids = {t: i for i, t in enumerate(tokenizer.VOCAB)}
    answer = [ids[t] for t in (" a", " block", " of", " code", "\n", "a", " block", " of")]
    assert first_repeat(answer, 3) is None  # by token ids nothing repeats
    forms = printed_forms(tokenizer)
    assert forms[ids["\n"]] == SPACE and forms[ids["a"]] == forms[ids[" a"]]
    assert first_printed_repeat(answer, tokenizer, 3) == 6  # "a block of" again: its 7th printed token
    scores = NoRepeatPrintedNGram(4, tokenizer)(torch.tensor([answer]), torch.zeros(1, len(tokenizer)))
    barred = {tokenizer.VOCAB[i] for i in torch.nonzero(scores[0] == -float("inf")).flatten().tolist()}
    assert barred == {" code", "code"}  # either way "a block of code" would print twice
    with pytest.raises(ValueError, match="at least 1"):
        NoRepeatPrintedNGram(0, tokenizer)


def test_the_rule_keeps_the_greedy_answer_until_it_would_repeat_an_ngram(compressor):
    """Greedy decoding under no_repeat_ngram_size=n is today's answer up to the token that would complete a repeated
    n-gram of printed tokens (so only answers that repeat one can change), and from there never repeats one."""
    model, n = compressor.model, 8
    forms = printed_forms(model.tokenizer)

    def printed(ids: list[int]) -> list[int]:
        return [f for f in forms[ids].tolist() if f != SPACE]

    def first_any_repeat(ids: list[int]) -> int | None:
        """The first token that completes a repeated n-gram of token ids or of printed forms."""
        return next((end - 1 for end in range(1, len(ids) + 1)
                     if first_repeat(ids[:end], n) is not None or first_repeat(printed(ids[:end]), n) is not None),
                    None)

    with torch.no_grad():
        states = compressor.model.compress([model.tokenizer(t)["input_ids"] for t in TEXTS])
    prompts = [model.tokenizer("Where does the falcon hunt?")["input_ids"], model.tokenizer("Bread?")["input_ids"]]

    def answers(**settings) -> list[list[int]]:
        texts = generate(model, [states, states[1:]], prompts, GenerationSettings(max_new_tokens=60, **settings))
        return [model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]  # a token a character

    for plain, ruled in zip(answers(), answers(no_repeat_ngram_size=n)):
        at = first_any_repeat(plain)
        assert at is not None, "the random tiny model loops: the rule has something to stop"
        assert ruled[:at] == plain[:at] and ruled[at] != plain[at]
        assert first_any_repeat(ruled) is None


def test_nugget_llm_answers_without_repeating_an_ngram_by_default(compressor):
    request = {"documents": TEXTS, "question": "Where does the falcon hunt?"}
    default = NuggetLLM(compressor=compressor, max_new_tokens=60)
    assert default.no_repeat_ngram_size == ANSWER_NO_REPEAT_NGRAM_SIZE > 0
    answer = default.invoke(request).content
    loops = NuggetLLM(compressor=compressor, max_new_tokens=60, no_repeat_ngram_size=0).invoke(request).content
    assert first_repeat(loops, ANSWER_NO_REPEAT_NGRAM_SIZE) is not None  # the tiny tokenizer: a token a character
    assert first_repeat(answer, ANSWER_NO_REPEAT_NGRAM_SIZE) is None
    assert default.invoke(request, no_repeat_ngram_size=0).content == loops  # a call can turn it off

"""Answers that do not loop: the repeat finder, the no-repeat rule in generation, and NuggetLLM's default."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_nugget_model

from nugget_rag import NuggetCompressor, NuggetLLM
from nugget_rag.config import ANSWER_NO_REPEAT_NGRAM_SIZE
from nugget_rag.generation import GenerationSettings, generate
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


def test_the_rule_keeps_the_greedy_answer_until_it_would_repeat_an_ngram(compressor):
    """Greedy decoding under no_repeat_ngram_size=n is today's answer up to the token that would complete a repeated
    n-gram (so only answers that repeat one can change), and from there never repeats one."""
    model, n = compressor.model, 8
    with torch.no_grad():
        states = compressor.model.compress([model.tokenizer(t)["input_ids"] for t in TEXTS])
    prompts = [model.tokenizer("Where does the falcon hunt?")["input_ids"], model.tokenizer("Bread?")["input_ids"]]

    def answers(**settings) -> list[list[int]]:
        texts = generate(model, [states, states[1:]], prompts, GenerationSettings(max_new_tokens=60, **settings))
        return [model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]  # a token a character

    for plain, ruled in zip(answers(), answers(no_repeat_ngram_size=n)):
        at = first_repeat(plain, n)
        assert at is not None, "the random tiny model loops: the rule has something to stop"
        assert ruled[:at] == plain[:at] and ruled[at] != plain[at]
        assert first_repeat(ruled, n) is None


def test_nugget_llm_answers_without_repeating_an_ngram_by_default(compressor):
    request = {"documents": TEXTS, "question": "Where does the falcon hunt?"}
    default = NuggetLLM(compressor=compressor, max_new_tokens=60)
    assert default.no_repeat_ngram_size == ANSWER_NO_REPEAT_NGRAM_SIZE > 0
    answer = default.invoke(request).content
    loops = NuggetLLM(compressor=compressor, max_new_tokens=60, no_repeat_ngram_size=0).invoke(request).content
    assert first_repeat(loops, ANSWER_NO_REPEAT_NGRAM_SIZE) is not None  # the tiny tokenizer: a token a character
    assert first_repeat(answer, ANSWER_NO_REPEAT_NGRAM_SIZE) is None
    assert default.invoke(request, no_repeat_ngram_size=0).content == loops  # a call can turn it off

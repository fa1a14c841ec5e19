"""NuggetStreamLLM: LangChain's chat-model contract over autoregressive mode, prompts of any length, and the
conversation memory."""

import pytest
from langchain_core.messages import HumanMessage
from langchain_tests.unit_tests import ChatModelUnitTests
from standard import NuggetStreamLLMSuite
from tiny import tiny_base

from nugget_rag.components.stream_llm import NuggetStreamLLM
from nugget_rag.config import NuggetConfig
from nugget_rag.model import NuggetModel

READING = {"window": 16, "segment": 16}


@pytest.fixture(scope="module")
def nuggets():
    return NuggetModel(tiny_base(max_positions=64), NuggetConfig(ratio=4, scorer_layer=2, lora={"rank": 4}))


class TestNuggetStreamLLMStandard(NuggetStreamLLMSuite, ChatModelUnitTests):
    @pytest.fixture(autouse=True)
    def _params(self, nuggets):
        self.params = {"model": nuggets, "reading": READING, "max_new_tokens": 4}


def test_a_prompt_longer_than_the_positions_is_read(nuggets):
    llm = NuggetStreamLLM(model=nuggets, reading=READING, max_new_tokens=5)
    answer = llm.invoke("Summarise: " + "the fox jumps over the dog. " * 10)
    meta = answer.response_metadata
    assert answer.usage_metadata["input_tokens"] > 3 * 64
    assert meta["tokens_read"] == answer.usage_metadata["total_tokens"]
    assert meta["kv_size"] <= 64 and meta["dropped"] > 0


def test_a_continued_conversation_reads_only_its_new_turns_and_answers_as_rereading(nuggets):
    kept = NuggetStreamLLM(model=nuggets, reading=READING, max_new_tokens=6)
    fresh = NuggetStreamLLM(model=nuggets, reading=READING, max_new_tokens=6, conversations=0)
    history = [HumanMessage("Hello, who are you?")]
    first = kept.invoke(history)
    history += [first, HumanMessage("And what do you do?")]
    second = kept.invoke(history)
    assert second.usage_metadata["input_token_details"]["cache_read"] == first.usage_metadata["total_tokens"]
    again = fresh.invoke(history)
    assert again.usage_metadata["input_token_details"]["cache_read"] == 0
    assert second.content == again.content


def test_a_branched_conversation_starts_a_new_stream(nuggets):
    llm = NuggetStreamLLM(model=nuggets, reading=READING, max_new_tokens=3)
    llm.invoke("first question")
    other = llm.invoke("another question")
    assert other.usage_metadata["input_token_details"]["cache_read"] == 0

"""What LangChain's standard chat-model suites (unit and integration) need to know about NuggetLLM."""

from nugget_rag import NuggetLLM


class NuggetLLMSuite:
    """NuggetLLM has no tool calling or structured output; `params` (set by a fixture) are its constructor's."""

    params: dict

    @property
    def chat_model_class(self):
        return NuggetLLM

    @property
    def chat_model_params(self):
        return self.params

    @property
    def has_tool_calling(self):
        return False

    @property
    def has_structured_output(self):
        return False


class NuggetStreamLLMSuite(NuggetLLMSuite):
    @property
    def chat_model_class(self):
        from nugget_rag.components.stream_llm import NuggetStreamLLM

        return NuggetStreamLLM

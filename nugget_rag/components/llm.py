"""NuggetLLM: a LangChain chat model whose decoder reads the nuggets of the given documents."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.prompt_values import ChatPromptValue, PromptValue
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import ANSWER_NO_REPEAT_NGRAM_SIZE, DECODER
from ..generation.batching import BatchedGenerator
from ..generation.decoding import GenerationSettings, RowSteps, generation_steps
from ..model.nugget_model import NuggetModel
from ..prompts import QA_PROMPT, chat_token_ids, check_template, render_instruction, takes_question
from .compressor import NuggetCompressor, as_documents
from .resolution import ResolutionPolicy, UniformResolution, default_resolution, resolve_policy

DOCUMENTS_KEY = "documents"
_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "user", "chat": "user"}


class GenerationOptions(BaseModel):
    """The generation settings a chat model takes as fields, each overridable per call (`invoke(..., top_p=0.9)`),
    and what the package's chat models share (`_generate` from `_stream`, LangSmith parameters)."""

    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    finish_sentence: int = Field(32, ge=0, description="Past max_new_tokens, up to this many more tokens to end the "
                                 "sentence the limit cut, so an answer never stops mid-sentence for it; 0: a hard limit.")
    stop: list[str] | None = None
    seed: int | None = None
    repetition_penalty: float = Field(1.0, ge=1.0, allow_inf_nan=False, description="Above 1 discourages repeating generated tokens.")
    no_repeat_ngram_size: int = Field(ANSWER_NO_REPEAT_NGRAM_SIZE, ge=0, description="Never repeat a generated n-gram "
                                      "of this many tokens (0: off); the default keeps a small model from looping.")

    def generation_settings(self, stop: list[str] | None, overrides: Mapping[str, Any]) -> GenerationSettings:
        names = ("max_new_tokens", "finish_sentence", "temperature", "top_p", "seed", "repetition_penalty",
                 "no_repeat_ngram_size")
        return GenerationSettings(stop=list(stop or self.stop or []),
                                  **{name: overrides.get(name, getattr(self, name)) for name in names})

    @property
    def nugget_model(self) -> NuggetModel:
        raise NotImplementedError

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """The whole answer, from `_stream` (the chat models stream natively)."""
        final: ChatGenerationChunk | None = None
        for chunk in self._stream(messages, stop=stop, run_manager=run_manager, **kwargs):
            final = chunk if final is None else final + chunk
        message = AIMessage(content=final.message.content, response_metadata=final.message.response_metadata,
                            usage_metadata=final.message.usage_metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params.update(ls_provider="nugget-rag", ls_model_name=kwargs.get("model", self.nugget_model.base_name),
                      ls_max_tokens=kwargs.get("max_new_tokens", self.max_new_tokens))
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop)
        return params


def chat_dicts(messages: Sequence[BaseMessage], system_prompt: str | None) -> list[dict[str, str]]:
    """LangChain messages as chat-template {role, content} dicts, the system prompt first unless one is given."""
    chat = [{"role": _ROLES.get(m.type, "user"), "content": m.text} for m in messages]
    if system_prompt and not any(m["role"] == "system" for m in chat):
        chat.insert(0, {"role": "system", "content": system_prompt})
    return chat


class NuggetLLM(GenerationOptions, BaseChatModel):
    """Generates with the Dodo decoder conditioned on the nuggets of any number of documents.

    Input contract (any of):
    - ``{"documents": [Document | str, ...], "question": str}``: the output of ``retriever | compressor`` and the
      user's question, as built by ``{"documents": retriever | compressor, "question": RunnablePassthrough()}``;
    - a string or a list of messages, with documents passed as ``documents=[...]`` (``invoke(..., documents=d)`` or
      ``.bind(documents=d)``), or carried in a human message's ``additional_kwargs["documents"]``;
    - no documents at all: a plain chat model (documents that are all empty or whitespace are a ValueError).
    With documents, the last human message fills the ``{question}`` of `prompt_template` (its only placeholder;
    default: the paper's QA prompt, Appendix D; a template without it, such as SUMMARY_PROMPT, takes an empty
    message), and the decoder reads the chat-formatted prompt with each document where Full's prompt has its text: at
    the start of that message (`NuggetConfig.placement`; checkpoints trained before the setting existed read them
    ahead of the whole prompt). How each document is read (whole as text, as nuggets at some r, or dropped) is
    `resolution`'s plan for the question; by default the chain's: the passage the question is likeliest under read
    whole as text, the others dropped (`default_resolution()`); for a summary (a template without {question}), every
    document as nuggets at the compressor's ratio. Documents already compressed by a NuggetCompressor are read from
    its store, by the key their metadata names, each state once a question; others are compressed on the fly.

    Output: the answer's ``response_metadata`` holds ``sources`` (per document read: its ``index`` among the
    documents given, its ``id`` if any, ``read_as`` "text" or "nuggets", and its metadata without nugget details),
    ``resolution`` (every document's reading and why) and ``resolution_policy``, ``n_document_tokens`` (the
    documents' length as text), the positions read as ``n_nuggets`` and as ``n_text_tokens``, the
    ``compression_ratio`` achieved (document tokens per position read) and OpenAI's ``finish_reason``
    ("stop": the answer ended, or reached a stop string; "length": max_new_tokens or the model's positions cut it).
    ``usage_metadata`` counts what the decoder read (prompt tokens plus nuggets; ``input_token_details``: nuggets
    read from the store as ``cache_read``, nuggets compressed for this call as ``cache_creation``) and the tokens it
    generated; a stream carries it on its last chunk.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    compressor: NuggetCompressor
    prompt_template: str = Field(QA_PROMPT, description="Instruction with a {question} placeholder.")
    system_prompt: str | None = None
    batcher: BatchedGenerator | None = Field(
        None, description="Decode in batches shared with concurrent calls (one BatchedGenerator for all of them).")
    resolution: ResolutionPolicy | Literal["default"] = Field(
        "default", description="How each document is read (components/resolution.py): a policy, or a name of RESOLUTIONS. "
        "'default': default_resolution() when the documents come with a question, else (summaries) "
        "UniformResolution: every document as nuggets at the compressor's ratio.")

    @field_validator("prompt_template")
    @classmethod
    def _check_prompt_template(cls, value: str) -> str:
        return check_template(value)

    @field_validator("resolution", mode="before")
    @classmethod
    def _check_resolution(cls, value: object) -> ResolutionPolicy | str:
        if value is None:
            raise ValueError("resolution=None is not a reading: give 'uniform' for every document at the "
                             "compressor's ratio, 'default', another name of RESOLUTIONS, or a ResolutionPolicy")
        return value if value == "default" else resolve_policy(value)

    @property
    def nugget_model(self) -> NuggetModel:
        return self.compressor.model

    @property
    def _llm_type(self) -> str:
        return "nugget-rag"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"base_model": self.compressor.model.base_name, "ratio": self.compressor.effective_ratio,
                "prompt_template": self.prompt_template, "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature}

    # ------------------------------------------------------------------ input contract
    def _convert_input(self, model_input: LanguageModelInput | Mapping[str, Any]) -> PromptValue:
        if isinstance(model_input, Mapping):
            unknown = set(model_input) - {DOCUMENTS_KEY, "question"}
            if unknown:
                raise ValueError(f"unknown key(s) {sorted(map(str, unknown))} in the input: a dict input takes "
                                 f"'{DOCUMENTS_KEY}' (Documents or strings) and 'question'")
            if "question" not in model_input:
                raise ValueError(f"a dict input needs a 'question' key (and 'documents'); got keys {sorted(model_input)}")
            docs = as_documents(model_input.get(DOCUMENTS_KEY) or [])
            message = HumanMessage(
                content=str(model_input["question"]),
                additional_kwargs={DOCUMENTS_KEY: [d.model_dump(include={"page_content", "metadata", "id"}) for d in docs]},
            )
            return ChatPromptValue(messages=[message])
        return super()._convert_input(model_input)

    def _documents(self, messages: Sequence[BaseMessage], extra: Any) -> list[tuple[int, Document]]:
        """The non-empty documents given, each with its index among all the documents given."""
        docs = as_documents(extra) if extra is not None else []
        for message in messages:
            carried = message.additional_kwargs.get(DOCUMENTS_KEY, [])
            if isinstance(carried, Sequence) and not isinstance(carried, str):  # dicts: from _convert_input
                carried = [Document.model_validate(d) if isinstance(d, Mapping) else d for d in carried]
            docs += as_documents(carried)
        kept = [(i, d) for i, d in enumerate(docs) if d.page_content.strip()]
        if docs and not kept:
            raise ValueError(f"all {len(docs)} documents given are empty or whitespace; pass non-empty text, or call "
                             "without documents for a plain chat")
        return kept

    def _prompt_ids(self, chat: Sequence[dict[str, str]], with_documents: bool) -> tuple[list[int], list[int]]:
        """The decoder's token ids before and after the documents' nuggets (NuggetModel.chat_prompt), for the
        messages as `chat_dicts` gives them."""
        chat = list(chat)
        last = max((i for i, m in enumerate(chat) if m["role"] == "user"), default=None)
        asks = not with_documents or takes_question(self.prompt_template)
        if last is not None and asks and not chat[last]["content"].strip():
            raise ValueError(f"the question is empty ({chat[last]['content']!r}); ask something, or, to summarise the "
                             "documents, use a prompt_template without {question} such as SUMMARY_PROMPT")
        if with_documents:
            if last is None:
                raise ValueError("with documents, the input needs a human message holding the question")
            chat[last] = {"role": "user", "content": render_instruction(self.prompt_template, chat[last]["content"])}
            return self.compressor.model.chat_prompt(chat)
        return [], chat_token_ids(self.compressor.model.tokenizer, chat)

    # ------------------------------------------------------------------ resolution
    @property
    def policy(self) -> ResolutionPolicy:
        """The policy that reads the documents: `resolution`, or for "default" the chain's best measured one when
        documents come with a question, and for a summary every document as nuggets (UniformResolution)."""
        if self.resolution != "default":
            return self.resolution
        return default_resolution() if takes_question(self.prompt_template) else UniformResolution()

    @staticmethod
    def _question(chat: Sequence[dict[str, str]]) -> str:
        """The last user message's text: what the documents are read for."""
        return next((m["content"] for m in reversed(chat) if m["role"] == "user"), "")

    # ------------------------------------------------------------------ generation
    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        documents: Any = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        model_name = kwargs.get("model", self.compressor.model.base_name)
        if model_name != self.compressor.model.base_name:
            raise ValueError(f"this NuggetLLM serves {self.compressor.model.base_name!r}, not model={model_name!r}")
        given = self._documents(messages, documents)
        chat = chat_dicts(messages, self.system_prompt)
        prefix, prompt = self._prompt_ids(chat, with_documents=bool(given))
        policy = self.policy if given else None
        readings, found, adapter = (policy.read(self._question(chat), [d for _, d in given], self.compressor)
                                    if policy else ([], [], DECODER))
        planned = [i for i, _ in given]
        read = [(g, r) for g, r in zip(given, readings) if r.ratio is not None]
        given, kept = [g for g, _ in read], [r for _, r in read]
        docs = [d for _, d in given]
        states = [f.state for f in found]
        settings = self.generation_settings(stop, kwargs)
        if self.batcher is not None:
            steps = self.batcher.stream(states, prompt, settings, prefix=prefix, adapter=adapter)
        else:
            steps = RowSteps((pieces[0], done[0]) for pieces, done in generation_steps(
                self.compressor.model, [states], [prompt], settings, adapter=adapter, prefixes=[prefix]))
        generated = 0  # one token per step of the stream
        for piece in steps:
            generated += 1
            if piece:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
                if run_manager:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
        n_positions = sum(s.k for s in states)
        n_text_tokens = sum(s.k for s, r in zip(states, kept) if r.adapter is None)
        n_document_tokens = sum(s.n for s in states)
        cache_read = sum(f.state.k for f in found if f.cached)
        read = len(prefix) + len(prompt) + n_positions
        usage = UsageMetadata(
            input_tokens=read, output_tokens=generated, total_tokens=read + generated,
            input_token_details={"cache_read": cache_read, "cache_creation": n_positions - cache_read},
        )
        sources = [{"index": i, **({"id": d.id} if d.id is not None else {}), "read_as": r.as_metadata()["read_as"],
                    **{k: v for k, v in d.metadata.items() if k != "nuggets"}} for (i, d), r in zip(given, kept)]
        yield ChatGenerationChunk(
            message=AIMessageChunk(
                content="",
                response_metadata={
                    "sources": sources, "n_documents": len(docs), "n_document_tokens": n_document_tokens,
                    "n_nuggets": n_positions - n_text_tokens, "n_text_tokens": n_text_tokens,
                    "compression_ratio": n_document_tokens / n_positions if n_positions else None,
                    "model_name": self.compressor.model.base_name, "finish_reason": steps.finish_reason,
                    **({"resolution": [{"index": i, **r.as_metadata()} for i, r in zip(planned, readings)],
                        "resolution_policy": type(policy).__name__} if policy else {}),
                },
                usage_metadata=usage,
                chunk_position="last",
            )
        )

"""NuggetStreamLLM: a LangChain chat model that reads its whole prompt in autoregressive mode (autoregressive.py), so
a prompt of any length (a long document to summarise, a long conversation) is read in one pass."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGenerationChunk
from pydantic import ConfigDict, Field, PrivateAttr

from ..config import StreamSettings
from ..generation.autoregressive import NuggetStream
from ..model.checkpoint_files import DEFAULT_CHECKPOINT
from ..model.nugget_model import NuggetModel
from ..prompts import chat_token_ids
from .llm import GenerationOptions, chat_dicts


class NuggetStreamLLM(GenerationOptions, BaseChatModel):
    """Generates after reading the chat-formatted prompt left to right in autoregressive mode: the last `window`
    tokens stay whole, everything older survives as nuggets (at most `max_nuggets`, oldest dropped first), so
    memory and positions stay bounded however long the prompt is.

    It is also a chat memory: the streams of the last `conversations` calls are kept, and a call whose prompt
    continues one of them (the same earlier turns and the answer it gave, then new turns) reads only the new
    tokens. Older turns are then held as nuggets, recent ones verbatim; use it with RunnableWithMessageHistory.

    Output: ``response_metadata`` holds ``tokens_read`` (the conversation so far), ``kv_size`` (states the next
    token attends to), ``n_nuggets`` and ``dropped``; ``usage_metadata.input_token_details.cache_read`` counts the
    prompt tokens a kept stream had read already.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: NuggetModel
    reading: StreamSettings = Field(default_factory=StreamSettings, description="Window, segment, ratio, cap.")
    system_prompt: str | None = None
    conversations: int = Field(4, ge=0, description="Streams kept to continue a conversation without re-reading.")
    _kept: OrderedDict = PrivateAttr(default_factory=OrderedDict)  # ids read (tuple) -> NuggetStream
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def from_pretrained(cls, checkpoint: str | Path | None = DEFAULT_CHECKPOINT, base_model: str | Path | None = None,
                        device: str | None = None, dtype: str | None = None, **fields: Any) -> NuggetStreamLLM:
        """Load a nugget checkpoint (default: the shipped one); `fields` are this model's (`reading`, ...)."""
        return cls(model=NuggetModel.from_pretrained(checkpoint, base_model=base_model, device=device, dtype=dtype),
                   **fields)

    @property
    def nugget_model(self) -> NuggetModel:
        return self.model

    @property
    def _llm_type(self) -> str:
        return "nugget-rag-stream"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"base_model": self.model.base_name, **self.reading.model_dump(), "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature}

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        ids = chat_token_ids(self.model.tokenizer, chat_dicts(messages, self.system_prompt))
        settings = self.generation_settings(stop, kwargs)
        stream, read = self._take(ids)
        with torch.inference_mode():
            stream.feed(ids[len(read):])
        generated = 0
        try:
            for piece in stream.generate(settings):
                generated += 1
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
                if run_manager:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
        finally:
            self._keep(tuple(ids) + tuple(stream.generated), stream)
        usage = UsageMetadata(input_tokens=len(ids), output_tokens=len(stream.generated),
                              total_tokens=len(ids) + len(stream.generated),
                              input_token_details={"cache_read": len(read)})
        yield ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=usage, chunk_position="last",
            response_metadata={"tokens_read": stream.n, "kv_size": stream.kv_size,
                               "n_nuggets": int(stream.visible.sum()), "dropped": stream.dropped,
                               "model_name": self.model.base_name},
        ))

    # ------------------------------------------------------------------ kept conversations
    def _take(self, ids: list[int]) -> tuple[NuggetStream, tuple[int, ...]]:
        """The kept stream that has read the longest prefix of `ids` (taken out while in use), or a new one."""
        with self._lock:
            best = max((read for read in self._kept if len(read) <= len(ids) and tuple(ids[: len(read)]) == read),
                       key=len, default=None)
            if best is not None:
                return self._kept.pop(best), best
        return NuggetStream(self.model, self.reading), ()

    def _keep(self, read: tuple[int, ...], stream: NuggetStream) -> None:
        if not self.conversations:
            return
        with self._lock:
            self._kept[read] = stream
            while len(self._kept) > self.conversations:
                self._kept.popitem(last=False)

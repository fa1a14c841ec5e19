"""The bodies the server takes, validated before any work: a question (/ask), OpenAI's chat request
(/v1/chat/completions) and documents (/ingest, /compress, /summarize, /ingest/jobs). Text that is not valid Unicode (a lone
surrogate) is refused naming its field."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import HTTPException
from langchain_core.documents import Document
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..components.resolution import RESOLUTIONS
from ..config import ANSWER_NO_REPEAT_NGRAM_SIZE
from ..integrations.retrieval.summary_chain import SummaryReading


def _check_unicode(where: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{where} is not valid Unicode: {text[err.start:err.end]!r} at character {err.start} (a "
                         "lone surrogate); send UTF-8 text") from None


def _unicode(value: str, info: ValidationInfo) -> str:
    _check_unicode(info.field_name or "the text", value)
    return value


Text = Annotated[str, AfterValidator(_unicode)]


NO_REPEAT = "No n-gram of this many tokens twice in the answer (0: off); the default keeps answers from looping."
REPETITION_PENALTY = "Above 1, makes the tokens already generated less likely (1: off)."


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: Text
    k: int = Field(4, ge=1, le=64, description="Chunks to retrieve; `resolution` reads, skims or drops each.")
    resolution: str = Field("default", description=f"How each chunk is read: one of {', '.join(RESOLUTIONS)}.")
    max_new_tokens: int = Field(128, ge=1, le=2048)
    finish_sentence: int = Field(32, ge=0, le=256, description="Tokens past max_new_tokens to end the sentence it cut.")
    no_repeat_ngram_size: int = Field(ANSWER_NO_REPEAT_NGRAM_SIZE, ge=0, le=2048, description=NO_REPEAT)
    repetition_penalty: float = Field(1.0, ge=1.0, le=100.0, description=REPETITION_PENALTY)
    stream: bool = True
    passages: bool = Field(False, description="Also return every chunk retrieved: its reading, relevance, tokens and "
                           "nuggets (the page at / shows them).")

    @field_validator("resolution")
    @classmethod
    def _known_resolution(cls, value: str) -> str:
        if value not in RESOLUTIONS:
            raise ValueError(f"unknown resolution {value!r}: give one of {', '.join(RESOLUTIONS)}")
        return value

    @field_validator("question")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the question is empty")
        return value


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    role: str
    content: Text | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(BaseModel):
    """The part of OpenAI's chat completion request that applies (others, such as temperature, are accepted and
    ignored: answers are greedy), and /ask's settings against loops."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=2048)
    max_completion_tokens: int | None = Field(None, ge=1, le=2048, description="OpenAI's newer name for max_tokens.")
    stream: bool = False
    k: int = Field(4, ge=1, le=64)
    no_repeat_ngram_size: int = Field(ANSWER_NO_REPEAT_NGRAM_SIZE, ge=0, le=2048, description=NO_REPEAT)
    repetition_penalty: float = Field(1.0, ge=1.0, le=100.0, description=REPETITION_PENALTY)

    @property
    def limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 128


class DocumentBody(BaseModel):
    """A LangChain Document as JSON (Document.model_dump's fields; others ignored, as Document ignores them),
    validated here: a Document field lets a body without page_content raise a TypeError, a 500."""

    model_config = ConfigDict(extra="ignore")

    page_content: str
    metadata: dict[str, Any] = {}
    id: str | None = None
    type: Literal["Document"] = "Document"

    def document(self) -> Document:
        return Document(id=self.id, page_content=self.page_content, metadata=self.metadata)


class DocumentsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    documents: list[Text | DocumentBody] = Field(min_length=1, max_length=10_000)

    @field_validator("documents")
    @classmethod
    def _unicode_documents(cls, value: list[str | DocumentBody]) -> list[str | DocumentBody]:
        for i, doc in enumerate(value):
            if isinstance(doc, DocumentBody):
                _check_unicode(f"documents[{i}].page_content", doc.page_content)
                _check_unicode(f"documents[{i}].metadata", json.dumps(doc.metadata, ensure_ascii=False))
        return value

    def as_documents(self) -> list[Document]:
        return [d.document() if isinstance(d, DocumentBody) else Document(page_content=d) for d in self.documents]

    def at_most(self, limit: int, instead: str) -> list[Document]:
        """The documents, if no more than `limit` (the server's max_ingest_documents); else a 413 saying to do
        `instead`."""
        if len(self.documents) > limit:
            raise HTTPException(413, f"{len(self.documents)} documents in one request is over this server's limit "
                                     f"of {limit} (--max-ingest-documents): {instead}")
        return self.as_documents()


class SummarizeRequest(DocumentsRequest):
    """Documents read as one, in order, to summarise (POST /summarize)."""

    reading: SummaryReading | None = Field(None, description="How the nuggets are read (NuggetSummarizer's readings; "
                                           "default: its measured best).")
    max_new_tokens: int = Field(160, ge=1, le=2048)


__all__ = ["AskRequest", "ChatMessage", "ChatRequest", "DocumentBody", "DocumentsRequest", "SummarizeRequest",
           "TextPart"]

"""`nugget-rag serve`: a long-running HTTP server that keeps the model, the index and the nugget store warm.

    GET  /health                     {"status": "ok", "model", "ratio", "chunks", "pending", "batches", "mean_batch"}
    POST /ask      {"question", "k"?, "max_new_tokens"?, "stream"?}
                   stream (default): NDJSON lines {"text": piece}..., then {"sources": [...], "usage": {...}}
                   otherwise: {"answer", "sources", "usage"}
    POST /compress {"documents": [text | {"page_content", "metadata"?}]}  -> {"documents": [{"metadata"}]}
    POST /ingest   {"documents": [text | {"page_content", "metadata"?}]}  -> {"added", "chunks"}
    POST /v1/chat/completions   OpenAI's chat format (messages, max_tokens, stream as server-sent events): the last
                   user message is the question, answered from the retrieved chunks; the answer names its sources

Requests beyond `max_pending` in flight get 503; bodies over `max_body_bytes` get 413; malformed or incomplete JSON
gets 422. Answers to concurrent requests are decoded in shared batches of up to `max_batch` (batching.py); a
client that disconnects leaves its batch. Needs the [serve] and [retrieval] extras.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .batching import BatchedGenerator
from .llm import NuggetLLM


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str
    k: int = Field(4, ge=1, le=64, description="Chunks to read.")
    max_new_tokens: int = Field(128, ge=1, le=2048)
    stream: bool = True

    @field_validator("question")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the question is empty")
        return value


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    """The part of OpenAI's chat completion request that applies (others, such as temperature, are accepted and
    ignored: answers are greedy)."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int = Field(128, ge=1, le=2048)
    stream: bool = False
    k: int = Field(4, ge=1, le=64)


class DocumentsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    documents: list[str | Document] = Field(min_length=1, max_length=10_000)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before it is parsed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _too_large(self.limit, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"the request body is over {self.limit} bytes")
            return message

        return await self.app(scope, limited, send)


async def _too_large(limit: int, send) -> None:
    body = json.dumps({"detail": f"the request body is over {limit} bytes"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(index: Any, index_dir: str | Path | None = None, max_pending: int = 32,
               max_body_bytes: int = 1 << 20, max_batch: int = 8) -> BodyLimit:
    """The server (an ASGI app) over a loaded `NuggetIndex` (its compressor, store and FAISS index); `index_dir`:
    the index's directory, which /ingest updates as `nugget-rag ingest` does (None: the index stays in memory)."""
    from .integrations import NuggetIndex, build_qa_chain

    app = FastAPI(title="nugget-rag", description=__doc__.split("\n\n")[0])
    compressor = index.compressor
    batcher = BatchedGenerator(compressor.model, max_batch=max_batch)
    index_lock = threading.Lock()  # FAISS adds and searches, and saves, one at a time
    pending = {"count": 0}
    pending_lock = threading.Lock()

    def admit() -> None:
        with pending_lock:
            if pending["count"] >= max_pending:
                raise HTTPException(503, f"the server is busy ({max_pending} requests in flight); retry shortly")
            pending["count"] += 1

    def release() -> None:
        with pending_lock:
            pending["count"] -= 1

    @app.get("/health")
    def health() -> dict:
        sizes = batcher.batch_sizes
        return {"status": "ok", "model": compressor.model.base_name, "ratio": compressor.effective_ratio,
                "chunks": len(index), "pending": pending["count"], "batches": len(sizes),
                "mean_batch": round(sum(sizes) / len(sizes), 2) if sizes else None}

    def answer(request: AskRequest) -> Iterator[dict]:
        """Admit the request, retrieve its chunks, then yield {"text"} pieces and a last {"sources", "usage"}. The
        slot is freed when the iterator ends or is closed (a client that went away)."""
        if not len(index):
            raise HTTPException(409, "the index is empty: ingest documents first (POST /ingest)")
        admit()
        try:
            llm = NuggetLLM(compressor=compressor, max_new_tokens=request.max_new_tokens, batcher=batcher)
            with index_lock:
                docs = index.as_retriever(k=request.k).invoke(request.question)
            chain = build_qa_chain(RunnableLambda(lambda _: docs), llm)
        except BaseException:
            release()
            raise

        def pieces() -> Iterator[dict]:
            try:
                final = None
                for chunk in chain.stream(request.question):
                    final = chunk if final is None else final + chunk
                    if chunk.content:
                        yield {"text": chunk.content}
                yield {"sources": final.response_metadata.get("sources", []) if final else [],
                       "usage": final.usage_metadata if final else None}
            finally:
                release()

        return pieces()

    def whole(request: AskRequest) -> dict:
        parts = list(answer(request))
        return {"answer": "".join(p.get("text", "") for p in parts), **parts[-1]}

    @app.post("/ask")
    def ask(request: AskRequest):
        if not request.stream:
            return whole(request)
        lines = (json.dumps(piece).encode() + b"\n" for piece in answer(request))
        return StreamingResponse(lines, media_type="application/x-ndjson")

    @app.post("/v1/chat/completions")
    def chat(request: ChatRequest):
        questions = [m.content for m in request.messages if m.role == "user" and m.content.strip()]
        if not questions:
            raise HTTPException(422, "the messages hold no user message with a question")
        ask_request = AskRequest(question=questions[-1], k=request.k, max_new_tokens=request.max_tokens,
                                 stream=request.stream)
        model_name = compressor.model.base_name
        created = int(time.time())
        if not request.stream:
            result = whole(ask_request)
            usage = result["usage"] or {}
            return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created,
                    "model": model_name, "sources": result["sources"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": result["answer"]},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": usage.get("input_tokens", 0),
                              "completion_tokens": usage.get("output_tokens", 0),
                              "total_tokens": usage.get("total_tokens", 0)}}
        pieces = answer(ask_request)
        identity = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": created,
                    "model": model_name}

        def events() -> Iterator[bytes]:
            for message in pieces:
                delta = {"content": message["text"]} if "text" in message else {}
                chunk = {**identity, "choices": [{"index": 0, "delta": delta,
                                                  "finish_reason": None if delta else "stop"}]}
                if not delta:
                    chunk["sources"] = message["sources"]
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/compress")
    def compress(request: DocumentsRequest) -> dict:
        admit()
        try:
            out = compressor.invoke(list(request.documents))
        finally:
            release()
        return {"documents": [{"metadata": d.metadata} for d in out]}

    @app.post("/ingest")
    def ingest(request: DocumentsRequest) -> dict:
        nonlocal index
        admit()
        try:
            docs = [d if isinstance(d, Document) else Document(page_content=d) for d in request.documents]
            with index_lock:
                if index_dir is None:
                    added = index.ingest(docs)
                else:  # under the directory's lock, from what is saved there: another process's updates stay
                    settings = {"chunk_tokens": index.chunk_tokens, "chunk_overlap": index.chunk_overlap,
                                "batch_size": index.batch_size}
                    with NuggetIndex.updating(index_dir, compressor, index.embeddings, **settings) as updated:
                        added = updated.ingest(docs)
                    index = updated
        finally:
            release()
        return {"added": added, "chunks": len(index)}

    @app.exception_handler(ValueError)
    async def bad_value(request, err: ValueError) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status_code=422)

    return BodyLimit(app, max_body_bytes)

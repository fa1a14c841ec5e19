"""`nugget-rag serve`: a long-running HTTP server that keeps the model, the index and the nugget store warm.

    GET  /health                     {"status": "ok", "model", "ratio", "chunks", "pending"}
    POST /ask      {"question", "k"?, "max_new_tokens"?, "stream"?}
                   stream (default): NDJSON lines {"text": piece}..., then {"sources": [...], "usage": {...}}
                   otherwise: {"answer", "sources", "usage"}
    POST /compress {"documents": [text | {"page_content", "metadata"?}]}  -> {"documents": [{"metadata"}]}
    POST /ingest   {"documents": [text | {"page_content", "metadata"?}]}  -> {"added", "chunks"}

Requests beyond `max_pending` in flight get 503; bodies over `max_body_bytes` get 413; malformed or incomplete JSON
gets 422. Streams of concurrent requests interleave token by token (the model is taken one step at a time); a
client that disconnects ends its stream. Needs the [serve] and [retrieval] extras.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .llm import NuggetLLM


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1)
    k: int = Field(4, ge=1, le=64, description="Chunks to read.")
    max_new_tokens: int = Field(128, ge=1, le=2048)
    stream: bool = True

    @field_validator("question")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the question is empty")
        return value


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
               max_body_bytes: int = 1 << 20) -> FastAPI:
    """The server over a loaded `NuggetIndex` (its compressor, store and FAISS index); `index_dir`: where /ingest
    saves it (None: kept in memory)."""
    from .integrations import build_qa_chain
    from .integrations.faiss_store import LOCK_FILE

    app = FastAPI(title="nugget-rag", description=__doc__.split("\n\n")[0])
    compressor = index.compressor
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
        return {"status": "ok", "model": compressor.model.base_name, "ratio": compressor.effective_ratio,
                "chunks": len(index), "pending": pending["count"]}

    @app.post("/ask")
    def ask(request: AskRequest):
        if not len(index):
            raise HTTPException(409, "the index is empty: ingest documents first (POST /ingest)")
        admit()
        try:
            llm = NuggetLLM(compressor=compressor, max_new_tokens=request.max_new_tokens)
            with index_lock:
                docs = index.as_retriever(k=request.k).invoke(request.question)
            chain = build_qa_chain(RunnableLambda(lambda _: docs), llm)
        except BaseException:
            release()
            raise
        if not request.stream:
            try:
                answer = chain.invoke(request.question)
            finally:
                release()
            return {"answer": answer.content, "sources": answer.response_metadata["sources"],
                    "usage": answer.usage_metadata}

        def lines() -> Iterator[bytes]:
            try:
                final = None
                for chunk in chain.stream(request.question):
                    final = chunk if final is None else final + chunk
                    if chunk.content:
                        yield (json.dumps({"text": chunk.content}) + "\n").encode()
                meta = final.response_metadata if final is not None else {}
                usage = final.usage_metadata if final is not None else None
                yield (json.dumps({"sources": meta.get("sources", []), "usage": usage}) + "\n").encode()
            finally:  # also when the client went away and the stream was closed
                release()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

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
        admit()
        try:
            docs = [d if isinstance(d, Document) else Document(page_content=d) for d in request.documents]
            with index_lock:
                added = index.ingest(docs)
                if index_dir is not None:
                    from filelock import FileLock

                    with FileLock(Path(index_dir) / LOCK_FILE):
                        index.save(index_dir)
        finally:
            release()
        return {"added": added, "chunks": len(index)}

    @app.exception_handler(ValueError)
    async def bad_value(request, err: ValueError) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status_code=422)

    return BodyLimit(app, max_body_bytes)

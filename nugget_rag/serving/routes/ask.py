"""Questions: POST /ask (NDJSON lines, or one answer), and OpenAI's POST /v1/chat/completions (server-sent events,
or one completion) with GET /v1/models."""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, HTTPException, Request

from ..answers import begin_answer, streamed, whole_answer
from ..request_models import AskRequest, ChatRequest
from ..state import State

router = APIRouter()


@router.post("/ask")
async def ask(request: AskRequest, http: Request, state: State):
    if not request.stream:
        return await whole_answer(state, request, http)
    slot, pieces = await begin_answer(state, request, http)
    return streamed(state, slot, pieces, lambda piece: json.dumps(piece).encode() + b"\n",
                    lambda status, message: json.dumps({"error": {"message": message, "status": status}}).encode()
                    + b"\n", "application/x-ndjson")


@router.get("/v1/models")
def models(state: State) -> dict:
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.started,
                                        "owned_by": "nugget-rag"}]}


@router.post("/v1/chat/completions")
async def chat(request: ChatRequest, http: Request, state: State):
    questions = [m.text for m in request.messages if m.role == "user" and m.text.strip()]
    if not questions:
        raise HTTPException(422, "the messages hold no user message with a question")
    ask_request = AskRequest(question=questions[-1], k=request.k, max_new_tokens=request.limit,
                             finish_sentence=0,  # OpenAI's max_tokens is a hard limit
                             no_repeat_ngram_size=request.no_repeat_ngram_size,
                             repetition_penalty=request.repetition_penalty, stream=request.stream)

    identity = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
    if not request.stream:
        result = await whole_answer(state, ask_request, http)
        usage = result["usage"] or {}
        return {**identity, "object": "chat.completion", "sources": result["sources"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result["answer"]},
                             "finish_reason": result["finish_reason"]}],
                "usage": {"prompt_tokens": usage.get("input_tokens", 0),
                          "completion_tokens": usage.get("output_tokens", 0),
                          "total_tokens": usage.get("total_tokens", 0)}}
    slot, pieces = await begin_answer(state, ask_request, http)
    first = True

    def event(piece: dict) -> bytes:
        nonlocal first
        delta = {"role": "assistant", "content": piece.get("text", "")} if first else {}
        if "text" in piece:
            chunk = {**identity, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": {**delta, "content": piece["text"]}, "finish_reason": None}]}
        else:  # the last: an answer with no text (its first token ended it) still names the role
            chunk = {**identity, "object": "chat.completion.chunk", "sources": piece["sources"],
                     "choices": [{"index": 0, "delta": delta, "finish_reason": piece["finish_reason"]}]}
        first = False
        return f"data: {json.dumps(chunk)}\n\n".encode()

    def error(status: int, message: str) -> bytes:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return f"data: {json.dumps({'error': {'message': message, 'type': kind, 'code': status}})}\n\n".encode()

    return streamed(state, slot, pieces, event, error, "text/event-stream", end=b"data: [DONE]\n\n")

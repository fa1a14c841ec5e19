"""An answer to a question, from retrieval to its last piece: admitted, read from one index version, decoded in the
server's shared batches, then sent whole or streamed. A client that leaves, or a deadline, stops it at its next step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import anyio
from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse
from langchain_core.documents import Document
from langchain_core.runnables import Runnable

from ..cancellation import RequestCancelled, cancellable, check
from ..integrations import answer_chain, reading_view
from .admission import Slot, watched
from .errors import failure
from .request_models import AskRequest
from .state import AppState


class AnswerStream(StreamingResponse):
    """A streamed answer that calls `on_end` once the response is over: at once when its client went away."""

    def __init__(self, content, on_end: Callable[[], None], media_type: str):
        super().__init__(content, media_type=media_type)
        self.on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


async def begin_answer(state: AppState, request: AskRequest, http: Request) -> tuple[Slot, Iterator[dict]]:
    """Admit the request, retrieve its chunks and decode up to its answer's first piece, so that whatever refuses
    it does so before a response starts; then the answer: {"text"} pieces and a last {"sources", "usage",
    "finish_reason"}."""
    index = state.served.current()  # the version this question reads, whole
    if not len(index):
        raise HTTPException(409, "the index is empty: ingest documents first (POST /ingest)")
    slot = state.slots.admit()

    def begin() -> Iterator[dict]:
        """Retrieval, the reading plan (its probe) and the first piece, each stopping at its next step once the
        slot stops (the answer's batch then drops it); the slot is freed here if they fail, else when the answer's
        pieces end."""
        try:
            with cancellable(slot.stop):
                with state.search:
                    docs = index.as_retriever(k=request.k).invoke(request.question)
                check()
                chain = answer_chain(index, request.k, request.resolution, compressor=state.compressor, retrieved=docs,
                                     max_new_tokens=request.max_new_tokens, finish_sentence=request.finish_sentence,
                                     no_repeat_ngram_size=request.no_repeat_ngram_size,
                                     repetition_penalty=request.repetition_penalty, batcher=state.batcher)
                pieces = answer_pieces(state, chain, request.question, slot, docs if request.passages else None)
                return itertools.chain([next(pieces)], pieces)
        except RequestCancelled:
            slot.free("deadline")  # (a client that left has freed it already)
            raise
        except BaseException:
            slot.free()
            raise

    return slot, await watched(http, slot, begin)


def answer_pieces(state: AppState, chain: Runnable, question: str, slot: Slot,
                  passages: list[Document] | None) -> Iterator[dict]:
    """The answer's pieces, the last with every one of `passages` as reading_view shows it (None: without them);
    its slot is freed when they end, fail or are cancelled."""
    try:
        final = None
        for chunk in chain.stream(question):
            final = chunk if final is None else final + chunk
            if chunk.content:
                if final is chunk:
                    state.metrics.first_token.observe(time.monotonic() - slot.admitted)
                yield {"text": chunk.content}
        state.metrics.count_usage(final.usage_metadata)
        last = {"sources": final.response_metadata["sources"], "usage": final.usage_metadata,
                "finish_reason": final.response_metadata["finish_reason"]}
        if passages is not None:
            last["passages"] = [reading_view(state.compressor, passages[reading["index"]], reading)
                                for reading in final.response_metadata["resolution"]]
        yield last
    except RequestCancelled:
        slot.free("deadline")  # (a client that left has freed it already)
        raise
    finally:
        slot.free()


async def whole_answer(state: AppState, request: AskRequest, http: Request) -> dict:
    """The answer at once: {"answer", "sources", "usage", "finish_reason"} (and "passages" if asked)."""
    slot, pieces = await begin_answer(state, request, http)
    parts = await watched(http, slot, lambda: list(pieces))
    return {"answer": "".join(p.get("text", "") for p in parts), **parts[-1]}


def streamed(state: AppState, slot: Slot, pieces: Iterator[dict], render: Callable[[dict], bytes],
             error: Callable[[int, str], bytes], media_type: str, end: bytes = b"") -> AnswerStream:
    """A response streaming the rendered pieces; a failure ends it with `error`'s event, a client that leaves
    cancels the answer."""
    async def body():
        try:
            # abandoned on cancel: a client that left stops waiting; its answer stops at the next token
            while (piece := await anyio.to_thread.run_sync(next, pieces, None, abandon_on_cancel=True)) is not None:
                yield render(piece)
        except Exception as err:
            status, message = failure(err, state.settings.request_timeout_s)
            state.metrics.errors.labels(str(status)).inc()
            yield error(status, message)
            return
        if end:
            yield end

    return AnswerStream(body(), slot.disconnect, media_type)


__all__ = ["AnswerStream", "answer_pieces", "begin_answer", "streamed", "whole_answer"]

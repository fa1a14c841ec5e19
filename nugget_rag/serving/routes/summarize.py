"""POST /summarize: documents of any length read as one and summarised from their nuggets, kept in the server's
store, so that a second summary of them (or a question about the same text) compresses nothing."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from ...cancellation import cancellable
from ...integrations.retrieval.summary_chain import NuggetSummarizer
from ..admission import watched
from ..request_models import SummarizeRequest
from ..state import State

router = APIRouter()


@router.post("/summarize")
async def summarize(request: SummarizeRequest, http: Request, state: State) -> dict:
    docs = [d for d in request.at_most(state.settings.max_ingest_documents, "send fewer, longer documents")
            if d.page_content.strip()]
    if not docs:
        raise HTTPException(422, "every document is empty or whitespace: there is nothing to summarise")
    chosen = {"reading": request.reading} if request.reading else {}
    summarizer = NuggetSummarizer(compressor=state.compressor, max_new_tokens=request.max_new_tokens, **chosen)
    slot = state.slots.admit()

    def summary() -> dict:
        with cancellable(slot.stop):  # each batch of nuggets stored whole: what was stored stays
            answer = summarizer.invoke(docs)
        return {"summary": answer.content, "metadata": answer.response_metadata, "usage": answer.usage_metadata}

    return await watched(http, slot, lambda: slot.run(summary))

"""POST /compress: documents compressed into the nugget store, each answered with its nugget metadata."""

from __future__ import annotations

from fastapi import APIRouter, Request
from langchain_core.documents import Document

from ...cancellation import cancellable
from ..admission import watched
from ..request_models import DocumentsRequest
from ..state import State

router = APIRouter()
EMPTY = "the document is empty or whitespace: it has no nuggets"


@router.post("/compress")
async def compress(request: DocumentsRequest, http: Request, state: State) -> dict:
    docs = request.at_most(state.settings.max_ingest_documents, "send them in parts")
    slot = state.slots.admit()
    kept = [d for d in docs if d.page_content.strip()]

    def compressed() -> list[Document]:
        with cancellable(slot.stop):  # each batch stored whole: what was stored stays
            return state.compressor.invoke(kept)

    out = iter(await watched(http, slot, lambda: slot.run(compressed)))
    return {"documents": [{"metadata": next(out).metadata} if d.page_content.strip() else {"skipped": EMPTY}
                          for d in docs]}

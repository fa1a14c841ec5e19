"""Adding documents: POST /ingest (at once, answered when published) and background jobs under /ingest/jobs
(ingest_jobs.py). Both go through the served index's `ingest`."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..admission import watched
from ..ingest_jobs import IngestJob
from ..request_models import DocumentsRequest
from ..state import State

router = APIRouter()


@router.post("/ingest")
async def ingest(request: DocumentsRequest, http: Request, state: State) -> dict:
    docs = request.at_most(state.settings.max_ingest_documents,
                           "send them in parts, or as a background job (POST /ingest/jobs)")
    slot = state.slots.admit()
    added = await watched(http, slot, lambda: slot.run(lambda: state.served.ingest(docs, slot.stop)))
    return {"added": added, "chunks": len(state.served)}


@router.post("/ingest/jobs", status_code=202)
def submit_job(request: DocumentsRequest, response: Response, state: State) -> IngestJob:
    job = state.jobs.submit(request.as_documents())
    response.headers["Location"] = f"/ingest/jobs/{job.id}"
    return job


@router.get("/ingest/jobs")
def list_jobs(state: State) -> dict:
    return {"jobs": state.jobs.listed()}


@router.get("/ingest/jobs/{job_id}")
def job_status(job_id: str, state: State) -> IngestJob:
    return state.jobs.get(job_id)


@router.delete("/ingest/jobs/{job_id}")
def cancel_job(job_id: str, state: State) -> IngestJob:
    return state.jobs.cancel(job_id)

"""The server's own state: GET /health (open without the API key) and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ...state.redaction import redacted
from ..state import State

router = APIRouter()


@router.get("/health")
def health(state: State) -> dict:
    sizes = state.batcher.batch_sizes
    return redacted({"status": "ok", "model": state.model_name, "ratio": state.compressor.effective_ratio,
                     "chunks": len(state.served), "pending": state.slots.count, "ingest_jobs": state.jobs.active,
                     "batches": len(sizes), "mean_batch": round(sum(sizes) / len(sizes), 2) if sizes else None})


@router.get("/metrics")
def metrics(state: State) -> Response:
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)

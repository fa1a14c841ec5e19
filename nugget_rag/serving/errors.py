"""How errors become responses: {"detail"}, or OpenAI's {"error": {"message", "type", "code"}} under /v1/; and the
status and message of an error that ends a streamed answer after its first byte."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..cancellation import RequestCancelled
from ..state.redaction import redacted
from .admission import ClientGone
from .ingest_jobs import IngestJobError, JobConflict, JobNotFound, JobNotResumable, JobsUnavailable
from .state import app_state

log = logging.getLogger(__name__)

JOB_ERROR_STATUS = {JobNotFound: 404, JobConflict: 409, JobNotResumable: 409, JobsUnavailable: 503}  # ingest_jobs.py's errors


def failure(err: Exception, request_timeout_s: float) -> tuple[int, str]:
    """The status and message of `err`, which ends a request (or a streamed answer already under way)."""
    if isinstance(err, HTTPException):
        return err.status_code, str(err.detail)
    if isinstance(err, RequestCancelled):
        return 504, f"the request ran past the server's {request_timeout_s:g} s limit (--request-timeout)"
    if isinstance(err, ValueError):
        return 422, str(err)
    log.error("an answer failed after its stream started", exc_info=err)
    return 500, f"the answer failed: {type(err).__name__}: {redacted(str(err))}"


def refusal(request: Request, status: int, detail: Any, headers: dict | None = None) -> JSONResponse:
    """An error response: {"detail"}, or OpenAI's {"error": {"message", "type", "code"}} under /v1/; its secrets
    starred."""
    detail = redacted(detail)
    if not request.url.path.startswith("/v1/"):
        return JSONResponse({"detail": detail}, status_code=status, headers=headers)
    if not isinstance(detail, str):  # validation errors
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in detail)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": detail, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    return refusal(request, err.status_code, err.detail, err.headers)


async def job_error(request: Request, err: IngestJobError) -> JSONResponse:
    return refusal(request, JOB_ERROR_STATUS[type(err)], str(err))


async def bad_value(request: Request, err: ValueError) -> JSONResponse:
    return refusal(request, 422, str(err))


async def client_gone(request: Request, err: ClientGone) -> Response:
    return Response(status_code=499)  # nginx's "client closed request", for the logs and metrics: nobody reads it


async def cancelled(request: Request, err: RequestCancelled) -> JSONResponse:
    return refusal(request, *failure(err, app_state(request).settings.request_timeout_s))


async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    # without the input: it may be large, or not encodable (a lone surrogate)
    errors = [{key: value for key, value in e.items() if key != "input"} for e in err.errors()]
    return refusal(request, 422, jsonable_encoder(errors))


HANDLERS = {StarletteHTTPException: http_error, IngestJobError: job_error, ValueError: bad_value,
            ClientGone: client_gone, RequestCancelled: cancelled, RequestValidationError: invalid}


def add_error_handlers(app: FastAPI) -> None:
    """Answer each error `app`'s routes raise as HANDLERS say."""
    for kind, handler in HANDLERS.items():
        app.add_exception_handler(kind, handler)


__all__ = ["add_error_handlers", "failure", "refusal"]

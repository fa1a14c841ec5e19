"""`nugget-rag serve`: a long-running HTTP server that keeps the model, the index and the nugget store warm.

create_app assembles it: the state every route shares (state.py), the routers (routes/), the error responses
(errors.py) and the middleware around them (middleware.py). The package's docstring lists the endpoints.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI
from starlette.types import ASGIApp

from ..integrations.local.index import NuggetIndex
from .errors import add_error_handlers
from .local_index import local_index
from .middleware import ApiKey, BodyLimit
from .routes import ROUTERS
from .served_index import ServedIndex
from .state import AppState, ServerSettings


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """On start, the jobs into its index that stopped with their server resume (if `resume_jobs`); on shutdown, the
    server's ingest jobs under way are recorded as interrupted, their step ended."""
    if app.state.nugget.settings.resume_jobs:
        await anyio.to_thread.run_sync(app.state.nugget.jobs.resume_stale)
    yield
    await anyio.to_thread.run_sync(app.state.nugget.jobs.close)


def create_app(index: ServedIndex | NuggetIndex, index_dir: str | Path | None = None, **settings: Any) -> ASGIApp:
    """The server (an ASGI app) over `index`: a ServedIndex, or a loaded NuggetIndex served from this process
    (local_index.py: saved in `index_dir` after each ingest, as `nugget-rag ingest` does; kept in memory when
    None). `settings`: ServerSettings' fields (max_pending, request_timeout_s, api_key, ...)."""
    if isinstance(index, NuggetIndex):
        served = local_index(index, index_dir)
    elif index_dir is not None:
        raise ValueError(f"index_dir={str(index_dir)!r} is given with a {type(index).__name__}, which publishes its "
                         "own versions: leave index_dir out (it is for a NuggetIndex served from this process)")
    else:
        served = index
    state = AppState.build(served, ServerSettings(**settings))
    app = FastAPI(title="nugget-rag", description=__doc__.split("\n\n")[0], lifespan=lifespan)
    app.state.nugget = state
    for router in ROUTERS:
        app.include_router(router)
    add_error_handlers(app)
    wrapped: ASGIApp = BodyLimit(app, state.settings.max_body_bytes)
    if state.settings.api_key is not None:
        wrapped = ApiKey(wrapped, state.settings.api_key)
    return state.metrics.observe(wrapped, route_paths(app))


def route_paths(app: FastAPI) -> list[str]:
    """The paths `app` answers: its routers' and its API documentation's (the metrics count others as "other")."""
    documentation = [app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url]
    return [route.path for router in ROUTERS for route in router.routes] + [path for path in documentation if path]


__all__ = ["create_app"]

"""The server's routes, one router a concern."""

from . import admin, ask, compress, ingest, page, summarize

ROUTERS = [page.router, admin.router, ask.router, compress.router, summarize.router, ingest.router]

__all__ = ["ROUTERS"]

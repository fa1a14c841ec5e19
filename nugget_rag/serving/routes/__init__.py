"""The server's routes, one router a concern."""

from . import admin, ask, compress, ingest, page

ROUTERS = [page.router, admin.router, ask.router, compress.router, ingest.router]

__all__ = ["ROUTERS"]

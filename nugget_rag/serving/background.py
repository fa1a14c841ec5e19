"""A server in a background thread of this process (a notebook's, a test's, a benchmark's): its base URL while the
block runs, stopped after it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from starlette.types import ASGIApp


@contextmanager
def serve_in_thread(app: ASGIApp, host: str = "127.0.0.1", start_timeout_s: float = 60) -> Iterator[str]:
    """`app` (create_app's) served by uvicorn in a daemon thread on a free port of `host`: yields its base URL once
    it listens; on leaving, the server finishes the requests it has and stops."""
    import uvicorn

    with socket.socket() as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="error"))
    thread = threading.Thread(target=server.run, name="nugget-rag-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server on {host}:{port} did not start within {start_timeout_s} s")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


__all__ = ["serve_in_thread"]

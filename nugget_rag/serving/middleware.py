"""ASGI middleware of `nugget-rag serve` (nugget_rag/serving): a body limit, an API key, and Prometheus metrics."""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import time
from collections.abc import Callable, Collection

from fastapi import HTTPException


async def send_json(send, status: int, detail: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """A request body over `limit` bytes gets 413 before it is parsed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await send_json(send, 413, f"the request body is over {self.limit} bytes")
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"the request body is over {self.limit} bytes")
            return message

        return await self.app(scope, limited, send)


class ApiKey:
    """Every path but `open_paths` needs the key: `Authorization: Bearer <key>` (as OpenAI's clients send it), or
    HTTP Basic credentials with the key as the password (any user name: what a browser sends, after asking once,
    to open the page at / and for the page's own requests). A request without it, or with another, gets 401 with
    the same words whatever it sent, challenging both schemes. Keys are compared in constant time."""

    CHALLENGES = [(b"www-authenticate", b"Bearer"), (b"www-authenticate", b'Basic realm="nugget-rag", charset="UTF-8"')]

    def __init__(self, app, key: str, open_paths: Collection[str] = ("/health",)):
        if not key.strip():
            raise ValueError("the API key is empty: give a key, or None to serve without one")
        self.app, self.key, self.open_paths = app, key.encode(), set(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._authorized(scope):
            return await self.app(scope, receive, send)
        await send_json(send, 401, "this server needs an API key: send the header 'Authorization: Bearer <key>' (a "
                        "browser asks for it: any user name, the key as the password)", self.CHALLENGES)

    def _authorized(self, scope) -> bool:
        given = dict(scope.get("headers", [])).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        scheme, token = scheme.lower(), token.strip()
        if scheme == b"basic":  # base64 of "user:password"
            try:
                token = base64.b64decode(token, validate=True).partition(b":")[2]
            except binascii.Error:
                return False
        return hmac.compare_digest(token, self.key) and scheme in (b"bearer", b"basic")


class Metrics:
    """The server's Prometheus metrics, in a registry of their own (one per app); `observe` wraps the app to count
    its requests by path and status, and time them (a streamed answer until its last byte)."""

    LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

    def __init__(self, pending: Callable[[], int], jobs: Callable[[], int]):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        self.requests = Counter("nugget_rag_requests", "HTTP requests answered, by path and status",
                                ["path", "status"], registry=registry)
        self.errors = Counter("nugget_rag_errors", "Errors by status: 4xx and 5xx responses, and streamed answers "
                              "ended by an error event", ["status"], registry=registry)
        self.latency = Histogram("nugget_rag_request_seconds", "Time to answer a request, by path",
                                 ["path"], buckets=self.LATENCY_BUCKETS, registry=registry)
        self.first_token = Histogram("nugget_rag_first_token_seconds", "Time from admission to an answer's first "
                                     "piece", buckets=self.LATENCY_BUCKETS, registry=registry)
        Gauge("nugget_rag_pending_requests", "Requests admitted and not yet finished (the queue before "
              "--max-pending)", registry=registry).set_function(pending)
        Gauge("nugget_rag_ingest_jobs", "Ingest jobs queued or running (POST /ingest/jobs)",
              registry=registry).set_function(jobs)
        self.cancelled = Counter("nugget_rag_cancelled_requests", "Requests stopped before their end, by reason: "
                                 "disconnect (the client left) or deadline (--request-timeout)", ["reason"],
                                 registry=registry)
        self.tokens = Counter("nugget_rag_tokens", "Tokens of finished answers: in (prompt and nuggets read) and "
                              "out (generated)", ["direction"], registry=registry)
        self.nuggets = Counter("nugget_rag_nuggets_read", "Nuggets read by answers, by source: store (computed "
                               "before) or computed (at the question)", ["source"], registry=registry)

    def count_usage(self, usage: dict | None) -> None:
        """Count a finished answer's usage (NuggetLLM's usage_metadata)."""
        if not usage:
            return
        self.tokens.labels("in").inc(usage.get("input_tokens", 0))
        self.tokens.labels("out").inc(usage.get("output_tokens", 0))
        details = usage.get("input_token_details") or {}
        self.nuggets.labels("store").inc(details.get("cache_read", 0))
        self.nuggets.labels("computed").inc(details.get("cache_creation", 0))

    def render(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def observe(self, app, paths: Collection[str]):
        """`app`, counted and timed; requests to paths not in `paths` are counted under "other"."""
        paths = set(paths)

        async def observed(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            path = scope["path"] if scope["path"] in paths else "other"
            status, start = 500, time.perf_counter()

            async def sending(message):
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await app(scope, receive, sending)
            finally:
                self.requests.labels(path, str(status)).inc()
                if status >= 400:
                    self.errors.labels(str(status)).inc()
                self.latency.labels(path).observe(time.perf_counter() - start)

        return observed

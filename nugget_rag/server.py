"""`nugget-rag serve`: a long-running HTTP server that keeps the model, the index and the nugget store warm.

    GET  /                           a page to ask questions on: the answer streams in, and each retrieved passage
                                     shows its reading, its relevance and its nuggets (page.html)
    GET  /health                     {"status": "ok", "model", "ratio", "chunks", "pending", "batches", "mean_batch"}
    GET  /metrics                    Prometheus metrics: requests and errors by status, pending requests, cancelled
                                     requests, tokens in and out, nuggets read, latency histograms
    POST /ask      {"question", "k"?, "resolution"?, "max_new_tokens"?, "finish_sentence"?, "no_repeat_ngram_size"?,
                   "repetition_penalty"?, "stream"?, "passages"?};
                   k: chunks retrieved, resolution: how each is read (a name of nugget_rag.resolution.RESOLUTIONS,
                   default "default"), finish_sentence: tokens past max_new_tokens to end the sentence it cut
                   (default 32); no_repeat_ngram_size: no n-gram of this many tokens twice in the answer (default
                   ANSWER_NO_REPEAT_NGRAM_SIZE, 0: off), repetition_penalty (default 1: off); passages (default
                   false): the last line also holds "passages", every chunk retrieved with its reading, tokens and
                   nuggets (visualize.reading_view): what the page shows
                   stream (default): NDJSON lines {"text": piece}..., then {"sources", "usage", "finish_reason"}; a
                   failure after the first line ends the stream with {"error": {"message", "status"}}
                   otherwise: {"answer", "sources", "usage", "finish_reason"}; finish_reason as OpenAI's: "stop" (the
                   answer ended) or "length" (max_new_tokens, or the model's positions, cut it)
    POST /compress {"documents": [text | {"page_content", "metadata"?}]}
                   -> {"documents": [{"metadata"} | {"skipped": why}]}, one entry per input, in order
    POST /ingest   {"documents": [text | {"page_content", "metadata"?}]}  -> {"added", "chunks"}; questions are
                   answered meanwhile from the index as it was, and see the new one once it is saved. At most
                   `max_ingest_documents` documents (and on /compress): more get 413, naming the limit
    POST /ingest/jobs   the same body -> 202 {"id", "status": "queued", ...}, Location: /ingest/jobs/{id}: the
                   documents are ingested in the background, one job at a time, JOB_PART documents per step, each
                   step published to questions as it lands (ingest_jobs.py)
    GET  /ingest/jobs/{id}   {"id", "status": queued | running | done | failed | cancelled | interrupted,
                   "documents", "done" (documents ingested so far), "added" (new chunks so far), "error", "created",
                   "finished", "server" (host:pid running it), "heartbeat"}
    GET  /ingest/jobs        every job recorded in the nugget store (the last KEPT_JOBS finished), oldest first
    DELETE /ingest/jobs/{id} cancel a job of this server: it stops at its next batch (the steps it finished stay);
                   409 for a job another server runs
    GET  /v1/models             the served model, in OpenAI's format
    POST /v1/chat/completions   OpenAI's chat format (messages, max_tokens, stream as server-sent events): the last
                   user message is the question, answered from the retrieved chunks; the answer names its sources.
                   no_repeat_ngram_size and repetition_penalty as /ask's (extra fields, as vLLM takes them).
                   A failure after the first event ends the stream with a `data: {"error": {...}}` event

Job records and documents live in the nugget store, so a restarted server, or another one over the store, reports
them; a job whose server stopped is "interrupted", and resumes when a server over its index starts (`resume_jobs`),
or with `nugget-rag jobs resume ID`. More than MAX_JOBS jobs queued or running on one server get 503.
Requests beyond `max_pending` in flight get 503; bodies over `max_body_bytes` get 413; malformed or incomplete JSON
gets 422, and so does text that is not valid Unicode (a lone surrogate), naming its field. Whatever refuses a
request does so before a streamed answer's first byte: its first piece is decoded before the response starts.
Answers to concurrent requests are decoded in shared batches of up to `max_batch` (batching.py). A request whose
client disconnects, or that runs past `request_timeout_s` (504), frees its slot at once and stops at its next
step (cancellation.py): retrieval, each probe pass, each batch compressed or ingested, each decoded token (its row
leaves its batch). A stopped /ingest leaves the index as it was; the states stored before it stopped stay.
With an `api_key`, every path but /health needs `Authorization: Bearer <key>`, or HTTP Basic credentials with the
key as the password (what a browser sends for the page); 401 otherwise. Needs the [serve] and [retrieval] extras.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import anyio
from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from .batching import BatchedGenerator
from .cancellation import RequestCancelled, cancellable, check
from .config import ANSWER_NO_REPEAT_NGRAM_SIZE
from .ingest_jobs import IngestJob, IngestJobError, IngestJobs, JobConflict, JobNotFound, JobRecords, JobsUnavailable
from .llm import NuggetLLM
from .resolution import RESOLUTIONS
from .server_middleware import ApiKey, BodyLimit, Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

PAGE = Path(__file__).with_name("page.html")  # GET /
JOB_ERROR_STATUS = {JobNotFound: 404, JobConflict: 409, JobsUnavailable: 503}  # ingest_jobs.py's errors


def _check_unicode(where: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{where} is not valid Unicode: {text[err.start:err.end]!r} at character {err.start} (a "
                         "lone surrogate); send UTF-8 text") from None


def _unicode(value: str, info: ValidationInfo) -> str:
    _check_unicode(info.field_name or "the text", value)
    return value


Text = Annotated[str, AfterValidator(_unicode)]


NO_REPEAT = "No n-gram of this many tokens twice in the answer (0: off); the default keeps answers from looping."
REPETITION_PENALTY = "Above 1, makes the tokens already generated less likely (1: off)."


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: Text
    k: int = Field(4, ge=1, le=64, description="Chunks to retrieve; `resolution` reads, skims or drops each.")
    resolution: str = Field("default", description=f"How each chunk is read: one of {', '.join(RESOLUTIONS)}.")
    max_new_tokens: int = Field(128, ge=1, le=2048)
    finish_sentence: int = Field(32, ge=0, le=256, description="Tokens past max_new_tokens to end the sentence it cut.")
    no_repeat_ngram_size: int = Field(ANSWER_NO_REPEAT_NGRAM_SIZE, ge=0, le=2048, description=NO_REPEAT)
    repetition_penalty: float = Field(1.0, ge=1.0, le=100.0, description=REPETITION_PENALTY)
    stream: bool = True
    passages: bool = Field(False, description="Also return every chunk retrieved: its reading, relevance, tokens and "
                           "nuggets (the page at / shows them).")

    @field_validator("resolution")
    @classmethod
    def _known_resolution(cls, value: str) -> str:
        if value not in RESOLUTIONS:
            raise ValueError(f"unknown resolution {value!r}: give one of {', '.join(RESOLUTIONS)}")
        return value

    @field_validator("question")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the question is empty")
        return value


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    role: str
    content: Text | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(BaseModel):
    """The part of OpenAI's chat completion request that applies (others, such as temperature, are accepted and
    ignored: answers are greedy), and /ask's settings against loops."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=2048)
    max_completion_tokens: int | None = Field(None, ge=1, le=2048, description="OpenAI's newer name for max_tokens.")
    stream: bool = False
    k: int = Field(4, ge=1, le=64)
    no_repeat_ngram_size: int = Field(ANSWER_NO_REPEAT_NGRAM_SIZE, ge=0, le=2048, description=NO_REPEAT)
    repetition_penalty: float = Field(1.0, ge=1.0, le=100.0, description=REPETITION_PENALTY)

    @property
    def limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 128


class DocumentsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    documents: list[Text | Document] = Field(min_length=1, max_length=10_000)

    @field_validator("documents")
    @classmethod
    def _unicode_documents(cls, value: list[str | Document]) -> list[str | Document]:
        for i, doc in enumerate(value):
            if isinstance(doc, Document):
                _check_unicode(f"documents[{i}].page_content", doc.page_content)
                _check_unicode(f"documents[{i}].metadata", json.dumps(doc.metadata, ensure_ascii=False))
        return value

    def as_documents(self) -> list[Document]:
        return [d if isinstance(d, Document) else Document(page_content=d) for d in self.documents]


class _Slots:
    """Requests in flight, at most `limit`; each slot also holds its request's deadline."""

    def __init__(self, limit: int, timeout_s: float, metrics: Metrics):
        self.limit, self.timeout_s, self.metrics = limit, timeout_s, metrics
        self.count = 0
        self.lock = threading.Lock()

    def admit(self) -> _Slot:
        with self.lock:
            if self.count >= self.limit:
                raise HTTPException(503, f"the server is busy ({self.limit} requests in flight); retry shortly")
            self.count += 1
        return _Slot(self)


class _Slot:
    """One admitted request, freed once: when it ends, fails or is cancelled."""

    def __init__(self, slots: _Slots):
        self._slots = slots
        self.admitted = time.monotonic()
        self.deadline = self.admitted + slots.timeout_s
        self._gone = threading.Event()
        self._freed = False

    def stop(self) -> bool:
        """Whether its request's work must stop: its client left, or it ran past its deadline."""
        return self._gone.is_set() or time.monotonic() > self.deadline

    def run(self, work: Callable[[], T]) -> T:
        """`work()`, the slot freed when it ends (work that checks `stop` raises RequestCancelled once it stops)."""
        try:
            return work()
        except RequestCancelled:
            self.free("deadline")  # (a client that left has freed it already)
            raise
        finally:
            self.free()

    def free(self, cancelled: str | None = None) -> None:
        """Free the slot (once); `cancelled`: why its answer was cut off, for the metrics."""
        with self._slots.lock:
            if self._freed:
                return
            self._freed = True
            self._slots.count -= 1
        if cancelled:
            self._slots.metrics.cancelled.labels(cancelled).inc()

    def disconnect(self) -> None:
        """Its client left: its work stops at its next step (an answer leaves its batch at the next token), and the
        slot is free now."""
        self._gone.set()
        self.free("disconnect")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def watched(http: Request, slot: _Slot, work: Callable[[], T]) -> T:
    """`work()`, run in a thread; a client that disconnects meanwhile stops the slot (its work stops at its next step)
    and raises ClientGone at once."""
    outcome = {}
    async with anyio.create_task_group() as group:
        async def run():
            try:
                outcome["value"] = await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
            except Exception as err:
                outcome["error"] = err
            group.cancel_scope.cancel()

        group.start_soon(run)
        while not await http.is_disconnected():
            await anyio.sleep(0.1)
        slot.disconnect()
        group.cancel_scope.cancel()
    if "error" in outcome:
        raise outcome["error"]
    if "value" not in outcome:
        raise ClientGone()
    return outcome["value"]


class _Stream(StreamingResponse):
    """A streamed answer that calls `on_end` once the response is over: at once when its client went away."""

    def __init__(self, content, on_end: Callable[[], None], media_type: str):
        super().__init__(content, media_type=media_type)
        self.on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


def create_app(index: Any, index_dir: str | Path | None = None, max_pending: int = 32,
               max_body_bytes: int = 1 << 20, max_batch: int = 8, request_timeout_s: float = 600,
               api_key: str | None = None, max_ingest_documents: int = 100,
               ingest_documents: Callable[[list[Document]], int] | None = None, resume_jobs: bool = False):
    """The server (an ASGI app) over a loaded `NuggetIndex` (its compressor, store and vector store); `index_dir`:
    the index's directory, which /ingest updates as `nugget-rag ingest` does (None: the index stays in memory);
    `request_timeout_s`: a request still under way after this long stops at its next step (504); `api_key`: the key every path
    but /health needs (None: none); `max_ingest_documents`: the most documents one /ingest or /compress request
    takes (more: 413; POST /ingest/jobs takes more, in the background); `ingest_documents`: how /ingest and its jobs add
    documents instead, returning the new chunks, which `index` then holds (a Ray cluster's, integrations/ray_serve.py);
    `resume_jobs`: as it starts, the server resumes the ingest jobs into `index_dir` whose server stopped
    (IngestJobs.resume_stale)."""
    from .integrations import NuggetIndex, build_qa_chain, reading_view

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if resume_jobs:
            await anyio.to_thread.run_sync(jobs.resume_stale)
        yield
        await anyio.to_thread.run_sync(jobs.close)  # its jobs under way: recorded as interrupted, their step ended

    app = FastAPI(title="nugget-rag", description=__doc__.split("\n\n")[0], lifespan=lifespan)
    compressor = index.compressor
    model_name = compressor.model.base_name
    started = int(time.time())
    batcher = BatchedGenerator(compressor.model, max_batch=max_batch)
    index_lock = threading.Lock()  # held to search the index, and to publish or change it
    versions, published = itertools.count(1), 0  # of the index copies /ingest publishes
    metrics = Metrics(pending=lambda: slots.count, jobs=lambda: jobs.active)
    slots = _Slots(max_pending, request_timeout_s, metrics)

    def failure(err: Exception) -> tuple[int, str]:
        """The status and message of an error that ends a streamed answer."""
        if isinstance(err, HTTPException):
            return err.status_code, str(err.detail)
        if isinstance(err, RequestCancelled):
            return 504, f"the request ran past the server's {request_timeout_s:g} s limit (--request-timeout)"
        if isinstance(err, ValueError):
            return 422, str(err)
        log.error("an answer failed after its stream started", exc_info=err)
        return 500, f"the answer failed: {type(err).__name__}: {err}"

    page_html = PAGE.read_text(encoding="utf-8").replace(
        "__RESOLUTIONS__", "".join(f'<option value="{name}">{name}</option>' for name in RESOLUTIONS))

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return page_html

    @app.get("/health")
    def health() -> dict:
        sizes = batcher.batch_sizes
        return {"status": "ok", "model": model_name, "ratio": compressor.effective_ratio,
                "chunks": len(index), "pending": slots.count, "ingest_jobs": jobs.active, "batches": len(sizes),
                "mean_batch": round(sum(sizes) / len(sizes), 2) if sizes else None}

    @app.get("/metrics")
    def metrics_text() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list",
                "data": [{"id": model_name, "object": "model", "created": started, "owned_by": "nugget-rag"}]}

    async def answer(request: AskRequest, http: Request) -> tuple[_Slot, Iterator[dict]]:
        """Admit the request, retrieve its chunks and decode up to its answer's first piece, so that whatever refuses
        it does so before a response starts; then the answer: {"text"} pieces and a last {"sources", "usage",
        "finish_reason"}."""
        if not len(index):
            raise HTTPException(409, "the index is empty: ingest documents first (POST /ingest)")
        slot = slots.admit()

        def begin() -> Iterator[dict]:
            """Retrieval, the reading plan (its probe) and the first piece, each stopping at its next step once the
            slot stops (the answer's batch then drops it); the slot is freed here if they fail, else when the answer's
            pieces end."""
            try:
                with cancellable(slot.stop):
                    llm = NuggetLLM(compressor=compressor, max_new_tokens=request.max_new_tokens,
                                    finish_sentence=request.finish_sentence,
                                    no_repeat_ngram_size=request.no_repeat_ngram_size,
                                    repetition_penalty=request.repetition_penalty, batcher=batcher)
                    with index_lock:
                        docs = index.as_retriever(k=request.k).invoke(request.question)
                    check()
                    chain = build_qa_chain(RunnableLambda(lambda _: docs), llm, resolution=request.resolution)
                    pieces = decode(chain, request.question, slot, docs if request.passages else None)
                    return itertools.chain([next(pieces)], pieces)
            except RequestCancelled:
                slot.free("deadline")  # (a client that left has freed it already)
                raise
            except BaseException:
                slot.free()
                raise

        return slot, await watched(http, slot, begin)

    def decode(chain, question: str, slot: _Slot, passages: list[Document] | None) -> Iterator[dict]:
        """The answer's pieces, the last with every one of `passages` as reading_view shows it (None: without them);
        its slot is freed when they end, fail or are cancelled."""
        try:
            final = None
            for chunk in chain.stream(question):
                final = chunk if final is None else final + chunk
                if chunk.content:
                    if final is chunk:
                        metrics.first_token.observe(time.monotonic() - slot.admitted)
                    yield {"text": chunk.content}
            metrics.count_usage(final.usage_metadata)
            last = {"sources": final.response_metadata["sources"], "usage": final.usage_metadata,
                    "finish_reason": final.response_metadata["finish_reason"]}
            if passages is not None:
                last["passages"] = [reading_view(compressor, passages[reading["index"]], reading)
                                    for reading in final.response_metadata["resolution"]]
            yield last
        except RequestCancelled:
            slot.free("deadline")  # (a client that left has freed it already)
            raise
        finally:
            slot.free()

    async def whole(request: AskRequest, http: Request) -> dict:
        slot, pieces = await answer(request, http)
        parts = await watched(http, slot, lambda: list(pieces))
        return {"answer": "".join(p.get("text", "") for p in parts), **parts[-1]}

    def streamed(slot: _Slot, pieces: Iterator[dict], render: Callable[[dict], bytes],
                 error: Callable[[int, str], bytes], media_type: str, end: bytes = b"") -> _Stream:
        """A response streaming the rendered pieces; a failure ends it with `error`'s event, a client that leaves
        cancels the answer."""
        async def body():
            try:
                # abandoned on cancel: a client that left stops waiting; its answer stops at the next token
                while (piece := await anyio.to_thread.run_sync(next, pieces, None, abandon_on_cancel=True)) is not None:
                    yield render(piece)
            except Exception as err:
                status, message = failure(err)
                metrics.errors.labels(str(status)).inc()
                yield error(status, message)
                return
            if end:
                yield end

        return _Stream(body(), slot.disconnect, media_type)

    @app.post("/ask")
    async def ask(request: AskRequest, http: Request):
        if not request.stream:
            return await whole(request, http)
        slot, pieces = await answer(request, http)
        return streamed(slot, pieces, lambda piece: json.dumps(piece).encode() + b"\n",
                        lambda status, message: json.dumps({"error": {"message": message, "status": status}}).encode()
                        + b"\n", "application/x-ndjson")

    @app.post("/v1/chat/completions")
    async def chat(request: ChatRequest, http: Request):
        questions = [m.text for m in request.messages if m.role == "user" and m.text.strip()]
        if not questions:
            raise HTTPException(422, "the messages hold no user message with a question")
        ask_request = AskRequest(question=questions[-1], k=request.k, max_new_tokens=request.limit,
                                 finish_sentence=0,  # OpenAI's max_tokens is a hard limit
                                 no_repeat_ngram_size=request.no_repeat_ngram_size,
                                 repetition_penalty=request.repetition_penalty, stream=request.stream)

        identity = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        if not request.stream:
            result = await whole(ask_request, http)
            usage = result["usage"] or {}
            return {**identity, "object": "chat.completion", "sources": result["sources"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": result["answer"]},
                                 "finish_reason": result["finish_reason"]}],
                    "usage": {"prompt_tokens": usage.get("input_tokens", 0),
                              "completion_tokens": usage.get("output_tokens", 0),
                              "total_tokens": usage.get("total_tokens", 0)}}
        slot, pieces = await answer(ask_request, http)
        first = True

        def event(piece: dict) -> bytes:
            nonlocal first
            delta = {"role": "assistant", "content": piece.get("text", "")} if first else {}
            if "text" in piece:
                chunk = {**identity, "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {**delta, "content": piece["text"]}, "finish_reason": None}]}
            else:  # the last: an answer with no text (its first token ended it) still names the role
                chunk = {**identity, "object": "chat.completion.chunk", "sources": piece["sources"],
                         "choices": [{"index": 0, "delta": delta, "finish_reason": piece["finish_reason"]}]}
            first = False
            return f"data: {json.dumps(chunk)}\n\n".encode()

        def error(status: int, message: str) -> bytes:
            kind = "invalid_request_error" if status < 500 else "server_error"
            return f"data: {json.dumps({'error': {'message': message, 'type': kind, 'code': status}})}\n\n".encode()

        return streamed(slot, pieces, event, error, "text/event-stream", end=b"data: [DONE]\n\n")

    def bounded(request: DocumentsRequest, instead: str) -> list[Document]:
        """The request's documents, if no more than max_ingest_documents (413 otherwise, saying what to do)."""
        if len(request.documents) > max_ingest_documents:
            raise HTTPException(413, f"{len(request.documents)} documents in one request is over this server's limit "
                                     f"of {max_ingest_documents} (--max-ingest-documents): {instead}")
        return request.as_documents()

    @app.post("/compress")
    async def compress(request: DocumentsRequest, http: Request) -> dict:
        docs = bounded(request, "send them in parts")
        slot = slots.admit()
        kept = [d for d in docs if d.page_content.strip()]

        def compressed() -> list[Document]:
            with cancellable(slot.stop):  # each batch stored whole: what was stored stays
                return compressor.invoke(kept)

        out = iter(await watched(http, slot, lambda: slot.run(compressed)))
        return {"documents": [{"metadata": next(out).metadata} if d.page_content.strip()
                              else {"skipped": "the document is empty or whitespace: it has no nuggets"}
                              for d in docs]}

    def add_documents(docs: list[Document], stop: Callable[[], bool]) -> int:
        """Ingest `docs`, questions going on meanwhile: they are compressed, embedded and saved outside the index's
        lock, which is held only to publish the result (or, for an index kept in memory, to add the embedded
        chunks). Returns the number of new chunks. Once `stop()` is true the ingest stops at its next step and
        raises RequestCancelled, the index as it was (states stored meanwhile stay in the store)."""
        nonlocal index, published
        if ingest_documents is not None:
            with cancellable(stop):
                return ingest_documents(docs)
        if index_dir is None:
            with cancellable(stop):
                compressor.invoke(index.split(docs))  # into the store, where index.ingest then finds them
            with index_lock:
                return index.ingest(docs)
        # a copy read under the directory's lock, from what is saved there: another process's updates stay (with
        # the user's own vector store, which the copy shares, new chunks are searchable as each batch lands)
        settings = {"chunk_tokens": index.chunk_tokens, "chunk_overlap": index.chunk_overlap,
                    "batch_size": index.batch_size, "vectorstore": index.user_vectorstore}
        with NuggetIndex.updating(index_dir, compressor, index.embeddings, **settings) as updated:
            with cancellable(stop):  # cancelled, the copy is not saved
                added = updated.ingest(docs)
            version = next(versions)  # in the directory lock's order
        with index_lock:
            if version > published:  # never over a later ingest's copy
                index, published = updated, version
        return added

    jobs = IngestJobs(add_documents, JobRecords(compressor.store),
                      index=None if index_dir is None else str(Path(index_dir).resolve()))

    @app.post("/ingest")
    async def ingest(request: DocumentsRequest, http: Request) -> dict:
        docs = bounded(request, "send them in parts, or as a background job (POST /ingest/jobs)")
        slot = slots.admit()
        added = await watched(http, slot, lambda: slot.run(lambda: add_documents(docs, slot.stop)))
        return {"added": added, "chunks": len(index)}

    @app.post("/ingest/jobs", status_code=202)
    def submit_job(request: DocumentsRequest, response: Response) -> IngestJob:
        job = jobs.submit(request.as_documents())
        response.headers["Location"] = f"/ingest/jobs/{job.id}"
        return job

    @app.get("/ingest/jobs")
    def list_jobs() -> dict:
        return {"jobs": jobs.listed()}

    @app.get("/ingest/jobs/{job_id}")
    def job_status(job_id: str) -> IngestJob:
        return jobs.get(job_id)

    @app.delete("/ingest/jobs/{job_id}")
    def cancel_job(job_id: str) -> IngestJob:
        return jobs.cancel(job_id)

    def refusal(request: Request, status: int, detail: Any, headers: dict | None = None) -> JSONResponse:
        """An error response: {"detail"}, or OpenAI's {"error": {"message", "type", "code"}} under /v1/."""
        if not request.url.path.startswith("/v1/"):
            return JSONResponse({"detail": detail}, status_code=status, headers=headers)
        if not isinstance(detail, str):  # validation errors
            detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in detail)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse({"error": {"message": detail, "type": kind, "code": status}}, status_code=status,
                            headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return refusal(request, err.status_code, err.detail, err.headers)

    @app.exception_handler(IngestJobError)
    async def job_error(request: Request, err: IngestJobError) -> JSONResponse:
        return refusal(request, JOB_ERROR_STATUS[type(err)], str(err))

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, err: ValueError) -> JSONResponse:
        return refusal(request, 422, str(err))

    @app.exception_handler(ClientGone)
    async def gone(request: Request, err: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request", for the logs and metrics: nobody reads it

    @app.exception_handler(RequestCancelled)
    async def cancelled(request: Request, err: RequestCancelled) -> JSONResponse:
        return refusal(request, *failure(err))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        # without the input: it may be large, or not encodable (a lone surrogate)
        errors = [{key: value for key, value in e.items() if key != "input"} for e in err.errors()]
        return refusal(request, 422, jsonable_encoder(errors))

    paths = [route.path for route in app.routes]
    served = BodyLimit(app, max_body_bytes)
    if api_key is not None:
        served = ApiKey(served, api_key)
    return metrics.observe(served, paths)

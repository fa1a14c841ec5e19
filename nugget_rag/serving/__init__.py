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

Job records live in the nugget store, so a restarted server, or another one over the store, reports them; a job
whose server stopped is "interrupted" (its documents were in that server's memory: send the rest again, which
computes only the states not stored yet). More than MAX_JOBS jobs queued or running on one server get 503.
Requests beyond `max_pending` in flight get 503; bodies over `max_body_bytes` get 413; malformed or incomplete JSON
gets 422, and so does text that is not valid Unicode (a lone surrogate), naming its field. Whatever refuses a
request does so before a streamed answer's first byte: its first piece is decoded before the response starts.
Answers to concurrent requests are decoded in shared batches of up to `max_batch` (batching.py). A request whose
client disconnects, or that runs past `request_timeout_s` (504), frees its slot at once and stops at its next
step (cancellation.py): retrieval, each probe pass, each batch compressed or ingested, each decoded token (its row
leaves its batch). A stopped /ingest leaves the index as it was; the states stored before it stopped stay.
With an `api_key`, every path but /health needs `Authorization: Bearer <key>`, or HTTP Basic credentials with the
key as the password (what a browser sends for the page); 401 otherwise. Needs the [serve] and [retrieval] extras.

The package: app.py (create_app), served_index.py (the index it answers over: local_index.py's, or a Ray Serve
replica's), state.py (settings and the state every route shares), routes/ (one router a concern), answers.py (an
answer from retrieval to its last piece), admission.py (slots, deadlines, disconnects), request_models.py,
errors.py, middleware.py, ingest_jobs.py, page.html; background.py serves an app from a thread.
"""

from .app import create_app
from .background import serve_in_thread
from .local_index import DirectoryIndex, MemoryIndex, local_index
from .served_index import ServedIndex
from .state import AppState, ServerSettings

__all__ = ["AppState", "DirectoryIndex", "MemoryIndex", "ServedIndex", "ServerSettings", "create_app", "local_index",
           "serve_in_thread"]

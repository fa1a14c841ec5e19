"""`nugget-rag serve` on the tiny model and hash embeddings: endpoints, streaming, bad input, load.

Time bounds here are behaviour, not speed, and hold on a busy machine (scripts/stress_suite.sh): work is counted (no
step after a stop, fewer steps than a whole answer), slow steps end when the test says, and waits poll with a wide
limit. Speed under load is measured by benchmarks/job_latency.py (BENCHMARKS.md)."""

from __future__ import annotations

import base64
import http.client
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra")
from fastapi.testclient import TestClient  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from test_integrations import HashEmbeddings  # noqa: E402
from tiny import tiny_nugget_model  # noqa: E402

from nugget_rag import NuggetCompressor, NuggetModel, NuggetStore  # noqa: E402
from nugget_rag.cancellation import current_stop  # noqa: E402
from nugget_rag.config import ANSWER_NO_REPEAT_NGRAM_SIZE  # noqa: E402
from nugget_rag.generation import (
    batching,  # noqa: E402
    eos_ids,  # noqa: E402
)
from nugget_rag.generation import decoding as generation  # noqa: E402
from nugget_rag.generation.text import first_repeat  # noqa: E402
from nugget_rag.integrations import NuggetIndex  # noqa: E402
from nugget_rag.serving import DirectoryIndex, MemoryIndex, create_app, serve_in_thread  # noqa: E402
from nugget_rag.serving.ingest_jobs import IngestJob, JobRecords  # noqa: E402

TEXTS = ["The falcon hunts over the river valley and dives at great speed.",
         "Sourdough bread needs flour, water, salt and a starter culture."]


@pytest.fixture
def index(tmp_path):
    model = tiny_nugget_model()
    compressor = NuggetCompressor(model=model, store=NuggetStore(directory=tmp_path / "nuggets"))
    return NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=0)


@pytest.fixture
def client(index, tmp_path):
    with TestClient(create_app(index, tmp_path, max_pending=4, max_body_bytes=100_000)) as client:
        yield client


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Wait until `check()` holds; fail naming `what` if it does not within `timeout_s` (wide: a busy machine)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


@pytest.fixture
def slow_steps(monkeypatch):
    """Decoding at 20 ms a step or more: a long answer takes seconds. The times the steps were decoded."""
    steps, decoded = batching.generation_steps, []

    def slow(*args, **kwargs):
        for step in steps(*args, **kwargs):
            time.sleep(0.02)
            decoded.append(time.monotonic())
            yield step

    monkeypatch.setattr(batching, "generation_steps", slow)
    return decoded


def hold(embeddings, monkeypatch, texts: list[str]) -> None:
    """`embeddings` embed a batch holding any of `texts` only once the work it is part of is to stop (a cancelled
    job, a server that stops): a step under way that ends when asked to, however busy the machine."""
    embed, held = embeddings.embed_documents, set(texts)

    def embed_when_stopped(batch: list[str]) -> list[list[float]]:
        deadline = time.monotonic() + 60
        while held.intersection(batch) and not ((stop := current_stop()) and stop()):
            assert time.monotonic() < deadline, "the held step was never stopped"
            time.sleep(0.01)
        return embed(batch)

    monkeypatch.setattr(embeddings, "embed_documents", embed_when_stopped)


def test_ingest_then_ask_streams_the_answer_with_sources(client, tmp_path):
    assert client.post("/ask", json={"question": "What does the falcon do?"}).status_code == 409  # empty index
    added = client.post("/ingest", json={"documents": [{"page_content": TEXTS[0], "metadata": {"source": "birds"}},
                                                       TEXTS[1]]}).json()
    assert added == {"added": 2, "chunks": 2} and (tmp_path / "index.json").is_file()
    response = client.post("/ask", json={"question": "What does the falcon do?", "k": 1, "max_new_tokens": 4})
    lines = [json.loads(line) for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("application/x-ndjson")
    assert all("text" in line for line in lines[:-1]) and lines[-1]["sources"][0]["source"] in ("birds", )
    assert lines[-1]["usage"]["output_tokens"] >= 1
    whole = client.post("/ask", json={"question": "What does the falcon do?", "k": 1, "max_new_tokens": 4,
                                      "stream": False}).json()
    assert whole["answer"] == "".join(line.get("text", "") for line in lines)  # greedy: the same answer
    assert client.get("/health").json()["chunks"] == 2


def test_the_server_ingests_into_and_answers_from_the_users_vector_store(index, tmp_path):
    from langchain_core.vectorstores import InMemoryVectorStore

    vectors = InMemoryVectorStore(HashEmbeddings())
    own = NuggetIndex(index.compressor, vectorstore=vectors, chunk_tokens=64, chunk_overlap=0)
    with TestClient(create_app(own, tmp_path)) as client:
        added = client.post("/ingest", json={"documents": [{"page_content": TEXTS[0], "metadata": {"source": "birds"}},
                                                           TEXTS[1]]}).json()
        assert added == {"added": 2, "chunks": 2} and len(vectors.store) == 2
        assert json.loads((tmp_path / "index.json").read_text())["vectorstore"].endswith(":InMemoryVectorStore")
        whole = client.post("/ask", json={"question": "What does the falcon do?", "k": 1, "max_new_tokens": 4,
                                          "stream": False}).json()
        assert whole["sources"][0]["source"] == "birds"
        assert own.store_ids_of([whole["sources"][0]["id"]])[0] in vectors.store  # the chunk's id, read back


def test_compress_returns_nugget_metadata(client):
    documents = client.post("/compress", json={"documents": TEXTS}).json()["documents"]
    assert [d["metadata"]["nuggets"]["n_tokens"] for d in documents] == [len(t) for t in TEXTS]


def test_summarize_reads_the_store_the_second_time(client):
    body = {"documents": [" ".join(TEXTS)] * 1 + ["   "], "max_new_tokens": 3}
    first = client.post("/summarize", json=body)
    second = client.post("/summarize", json=body)
    assert first.status_code == second.status_code == 200
    assert not first.json()["metadata"]["cached"] and second.json()["metadata"]["cached"]
    assert second.json()["summary"] == first.json()["summary"]
    assert first.json()["metadata"]["n_document_tokens"] == len(" ".join(TEXTS))
    assert client.post("/summarize", json={"documents": ["  "]}).status_code == 422
    assert client.post("/summarize", json={"documents": ["x"], "reading": "skim"}).status_code == 422


@pytest.mark.parametrize(("body", "status", "message"), [
    (b"{not json", 422, "JSON"),
    (json.dumps({"k": 2}).encode(), 422, "question"),
    (json.dumps({"question": "   "}).encode(), 422, "empty"),
    (json.dumps({"question": "x", "k": 0}).encode(), 422, "k"),
    (b'{"question": "' + b"x" * 200_000 + b'"}', 413, "over 100000 bytes"),
])
def test_bad_requests_get_a_clear_4xx_and_the_server_stays_up(client, body, status, message):
    response = client.post("/ask", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status and message in response.text
    assert client.get("/health").json()["status"] == "ok"


def test_a_stored_state_in_an_unknown_format_is_recomputed(client, index, tmp_path):
    client.post("/ingest", json={"documents": TEXTS})
    for entry in (tmp_path / "nuggets").rglob("*"):
        if entry.is_file():
            entry.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"__metadata__":{}}')
    store = NuggetStore(directory=tmp_path / "nuggets")
    reopened = NuggetIndex.load(tmp_path, index.compressor.model_copy(update={"store": store}), HashEmbeddings())
    with TestClient(create_app(reopened, tmp_path)) as fresh:
        response = fresh.post("/ask", json={"question": "Bread?", "k": 2, "max_new_tokens": 2, "stream": False})
    assert response.status_code == 200 and store.stats["corrupt"] == 2


def test_a_client_leaving_mid_stream_frees_its_slot(client):
    client.post("/ingest", json={"documents": TEXTS})
    with client.stream("POST", "/ask", json={"question": "Bread?", "max_new_tokens": 64}) as response:
        next(response.iter_lines())
    eventually(lambda: client.get("/health").json()["pending"] == 0, "the slot freed")


def test_200_requests_from_8_clients_all_succeed(index):
    index.ingest([Document(page_content=t) for t in TEXTS])

    def ask(url: str, i: int) -> bytes:
        body = json.dumps({"question": f"Question {i}?", "k": 1, "max_new_tokens": 2, "stream": i % 2 == 0}).encode()
        request = urllib.request.Request(f"{url}/ask", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            return response.read()

    with serve_in_thread(create_app(index, None, max_pending=64)) as url, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: ask(url, i), range(200)))
    assert len(answers) == 200 and all(answers)


def test_openai_compatible_chat_completions(client):
    client.post("/ingest", json={"documents": TEXTS})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does the falcon do?"}]
    whole = client.post("/v1/chat/completions", json={"model": "any", "messages": messages, "max_tokens": 4,
                                                       "temperature": 0.2}).json()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["role"] == "assistant"
    assert whole["usage"]["completion_tokens"] >= 1 and whole["sources"]
    events = [line for line in client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4,
                                                                         "stream": True}).iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "length"  # 4 tokens
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "hi"}]}).status_code == 422
    assert client.get("/health").json()["pending"] == 0


def test_ask_and_the_openai_route_answer_without_loops_by_default_and_honour_the_settings(client):
    """The default against loops is on in /ask and /v1/chat/completions; each takes no_repeat_ngram_size and
    repetition_penalty (the random tiny model loops without them)."""
    client.post("/ingest", json={"documents": TEXTS})
    question, n = "What does the falcon do?", ANSWER_NO_REPEAT_NGRAM_SIZE

    def ask(**settings) -> str:
        return client.post("/ask", json={"question": question, "max_new_tokens": 60, "finish_sentence": 0,
                                         "stream": False, **settings}).json()["answer"]

    def chat(stream: bool = False, **settings) -> str:
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": 60, "stream": stream, **settings}
        response = client.post("/v1/chat/completions", json=body)
        if not stream:
            return response.json()["choices"][0]["message"]["content"]
        chunks = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line and line != "data: [DONE]"]
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)

    loops = ask(no_repeat_ngram_size=0)
    assert first_repeat(loops, n) is not None  # the tiny tokenizer: a token a character
    assert first_repeat(ask(), n) is None and ask() == ask(no_repeat_ngram_size=n)
    assert chat(no_repeat_ngram_size=0) == loops and chat() == ask() == chat(stream=True)
    penalised = ask(no_repeat_ngram_size=0, repetition_penalty=5.0)
    assert penalised != loops and chat(no_repeat_ngram_size=0, repetition_penalty=5.0) == penalised
    for bad in ({"no_repeat_ngram_size": -1}, {"repetition_penalty": 0.5}):
        assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}],
                                                         **bad}).status_code == 422


@pytest.fixture
def end_at_step(monkeypatch, index):
    """`end_at_step(n)`: the next answer's token at step `n` (from 0) is an end of sequence (None: as decoded)."""
    eos, real = min(eos_ids(index.compressor.model)), generation.next_token

    def script(n: int | None) -> None:
        steps = itertools.count()

        def scripted(logits, settings, generator):
            tokens = real(logits, settings, generator)
            if next(steps) == n:
                tokens[:] = eos
            return tokens

        monkeypatch.setattr(generation, "next_token", scripted)

    return script


@pytest.mark.parametrize(("eos_step", "reason"), [
    (2, "stop"),  # the last token max_tokens allows is the end of sequence: the answer ended, it was not cut
    (None, "length"),
    (0, "stop"),  # the first token ends it: no text, and the stream's one chunk still names the role
])
def test_finish_reason_says_whether_the_answer_ended_or_was_cut(client, end_at_step, eos_step, reason):
    client.post("/ingest", json={"documents": TEXTS})
    messages = [{"role": "user", "content": "What does the falcon do?"}]
    end_at_step(eos_step)
    whole = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3}).json()
    assert whole["choices"][0]["finish_reason"] == reason
    assert bool(whole["choices"][0]["message"]["content"]) is (eos_step != 0)
    assert whole["usage"]["completion_tokens"] == (3 if eos_step is None else eos_step + 1)
    end_at_step(eos_step)
    events = [e for e in client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3,
                                                                   "stream": True}).iter_lines() if e]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [reason]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and events[-1] == "data: [DONE]"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    end_at_step(eos_step)
    lines = [json.loads(line) for line in client.post("/ask", json={"question": "What does the falcon do?",
                                                                    "max_new_tokens": 3}).iter_lines() if line]
    assert lines[-1]["finish_reason"] == reason


def test_an_answer_cut_by_the_models_positions_has_finish_reason_length(client):
    client.post("/ingest", json={"documents": TEXTS})
    whole = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Falcons?"}],
                                                       "max_tokens": 2048}).json()  # the tiny model has 512 positions
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] < 512


def test_ingest_keeps_what_another_process_added_to_the_index_meanwhile(client, index, tmp_path):
    client.post("/ingest", json={"documents": [TEXTS[0]]})
    with NuggetIndex.updating(tmp_path, index.compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=0) as other:
        other.ingest([Document(page_content="Written by another process.")])
    assert client.post("/ingest", json={"documents": [TEXTS[1]]}).json() == {"added": 1, "chunks": 3}
    saved = NuggetIndex.load(tmp_path, index.compressor, HashEmbeddings())
    assert len(saved) == 3


def never() -> bool:
    return False


def test_a_question_reads_a_version_that_no_ingest_changes(index):
    index.ingest([Document(page_content=TEXTS[0])])
    served = MemoryIndex(index)
    before = served.current()
    assert served.ingest([Document(page_content=TEXTS[1])], never) == 1
    assert (len(before), len(served), len(index)) == (1, 2, 2)  # the given index grows; the version read stays
    assert before.vectorstore.index.ntotal == 1 and served.current().vectorstore.index.ntotal == 2
    assert served.current() is not index  # the next ingest adds to `index`, not to what questions read


def test_memory_ingests_at_once_compress_outside_the_turn_and_add_a_text_once(index, monkeypatch):
    """Two ingests of the same text at once: both compress and embed it (neither waits for the other's turn),
    each chunk once, and the index gets it once."""
    both_embedding, real_embed = threading.Barrier(2, timeout=60), index.embeddings.embed_documents
    monkeypatch.setattr(index.embeddings, "embed_documents", lambda texts: (both_embedding.wait(), real_embed(texts))[1])
    compressed, real_invoke = [], NuggetCompressor.invoke
    monkeypatch.setattr(NuggetCompressor, "invoke",
                        lambda self, chunks, *a, **k: (compressed.extend(chunks), real_invoke(self, chunks, *a, **k))[1])
    served = MemoryIndex(index)
    with ThreadPoolExecutor(2) as pool:
        added = sorted(pool.map(lambda _: served.ingest([Document(page_content=TEXTS[0])], never), range(2)))
    assert added == [0, 1] and len(served) == len(index) == 1
    assert len(compressed) == 2  # one chunk, once by each ingest; none looked up again in the turn
    assert index.last_ingest["added"] + index.last_ingest["skipped"] == index.last_ingest["chunks"] == 1


def test_an_ingest_never_publishes_over_a_later_ones_copy(index, tmp_path, monkeypatch):
    """Two ingests into a directory: the first to take its lock publishes last, and must not replace the second's
    index (which holds the first's chunks too) with its own older copy."""
    real, calls, later_published = NuggetIndex.updating, itertools.count(), threading.Event()

    @contextmanager
    def updating(*args, **kwargs):
        first = next(calls) == 0
        with real(*args, **kwargs) as updated:
            yield updated
        if first:  # saved: wait to publish until the later ingest has
            assert later_published.wait(60), "the later ingest did not publish"

    monkeypatch.setattr(NuggetIndex, "updating", updating)
    served = DirectoryIndex(index, tmp_path)
    with ThreadPoolExecutor(1) as pool:
        earlier = pool.submit(served.ingest, [Document(page_content=TEXTS[0])], never)
        eventually(lambda: (tmp_path / "index.json").exists(), "the earlier ingest saved")
        assert served.ingest([Document(page_content=TEXTS[1])], never) == 1 and len(served) == 2
        later_published.set()
        assert earlier.result() == 1
    assert len(served) == 2 and len(NuggetIndex.load(tmp_path, index.compressor, HashEmbeddings())) == 2


def test_create_app_refuses_settings_it_does_not_take(index, tmp_path):
    with pytest.raises(ValueError, match="index_dir=.* is given with a MemoryIndex"):
        create_app(MemoryIndex(index), tmp_path)
    with pytest.raises(ValueError, match="max_pendng"):
        create_app(index, None, max_pendng=4)
    with pytest.raises(ValueError, match="request_timeout_s"):
        create_app(index, None, request_timeout_s=0)


def first_line_then_leave(url: str, body: dict) -> None:
    """Open a streamed /ask, read its first line, and disconnect."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/ask", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and "text" in json.loads(response.readline())
    response.close()
    connection.close()


def pending(url: str) -> int:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
        return json.loads(response.read())["pending"]


def test_questions_are_answered_while_an_ingest_runs(client, index, monkeypatch):
    client.post("/ingest", json={"documents": TEXTS})
    embed, embedding, answered = index.embeddings.embed_documents, threading.Event(), threading.Event()

    def held(texts: list[str]) -> list[list[float]]:  # the ingest waits, mid-way, until the questions are answered
        embedding.set()
        assert answered.wait(60), "the questions were not answered"
        return embed(texts)

    monkeypatch.setattr(index.embeddings, "embed_documents", held)
    many = [f"Document {i} tells of falcons, rivers and bread number {i}." for i in range(20)]
    with ThreadPoolExecutor(1) as pool:
        ingesting = pool.submit(client.post, "/ingest", json={"documents": many})
        assert embedding.wait(60), "the ingest did not start"
        for _ in range(3):
            answer = client.post("/ask", json={"question": "Falcons?", "k": 1, "max_new_tokens": 2, "stream": False})
            assert answer.status_code == 200
        assert not ingesting.done()  # answered while the ingest was under way, not after it
        answered.set()
        assert ingesting.result().json() == {"added": 20, "chunks": 22}
    assert client.get("/health").json()["chunks"] == 22  # published once saved


def test_an_ingest_over_the_document_limit_gets_a_413_naming_it(index, tmp_path):
    with TestClient(create_app(index, tmp_path, max_ingest_documents=3)) as client:
        for path in ("/ingest", "/compress"):
            response = client.post(path, json={"documents": [f"Document {i}." for i in range(4)]})
            assert response.status_code == 413, response.text
            assert "4 documents in one request is over this server's limit of 3 (--max-ingest-documents)" in \
                response.json()["detail"]
        assert "POST /ingest/jobs" in client.post("/ingest", json={"documents": ["a."] * 4}).json()["detail"]
        assert client.post("/ingest", json={"documents": TEXTS}).json() == {"added": 2, "chunks": 2}


def wait_for_job(client, job_id: str) -> dict:
    eventually(lambda: client.get(f"/ingest/jobs/{job_id}").json()["status"] not in ("queued", "running"),
               f"job {job_id} ended", timeout_s=300)
    return client.get(f"/ingest/jobs/{job_id}").json()


def test_a_background_ingest_job_reports_progress_and_can_be_cancelled(index, tmp_path, monkeypatch):
    documents = [f"Document {i} tells of falcons and bread number {i}." for i in range(70)]  # 3 steps of 32
    with TestClient(create_app(index, tmp_path, max_ingest_documents=3)) as client:
        response = client.post("/ingest/jobs", json={"documents": documents})
        assert response.status_code == 202 and response.json()["documents"] == 70
        job_id = response.json()["id"]
        assert response.headers["location"] == f"/ingest/jobs/{job_id}"
        job = wait_for_job(client, job_id)
        assert (job["status"], job["done"], job["added"], job["error"]) == ("done", 70, 70, None)
        assert client.get("/health").json()["chunks"] == 70 and len(NuggetIndex.load(tmp_path, index.compressor,
                                                                                      HashEmbeddings())) == 70
        more = [f"More {i} on rivers." for i in range(70)]
        hold(index.embeddings, monkeypatch, more[32:])  # its second step ends once cancelled
        slow = client.post("/ingest/jobs", json={"documents": more}).json()
        eventually(lambda: client.get(f"/ingest/jobs/{slow['id']}").json()["done"] > 0, "the first step landed")
        assert client.delete(f"/ingest/jobs/{slow['id']}").json()["status"] == "cancelled"
        time.sleep(0.5)  # the step under way ends (held until now, so no later one can have started)
        cancelled = client.get(f"/ingest/jobs/{slow['id']}").json()
        assert cancelled["status"] == "cancelled" and 32 <= cancelled["done"] < 70
        assert [j["id"] for j in client.get("/ingest/jobs").json()["jobs"]] == [job_id, slow["id"]]
        assert client.get("/health").json()["ingest_jobs"] == 0
        missing = client.get("/ingest/jobs/ingest-nope")
        assert missing.status_code == 404 and "'ingest-nope'" in missing.json()["detail"]


def test_job_errors_map_to_their_status_codes(index, tmp_path, monkeypatch):
    """ingest_jobs.py raises domain errors; the server answers each with its status and the error's message."""
    from nugget_rag.serving import ingest_jobs

    monkeypatch.setattr(ingest_jobs, "MAX_JOBS", 0)
    with TestClient(create_app(index, tmp_path)) as client:
        busy = client.post("/ingest/jobs", json={"documents": ["a."]})
        assert busy.status_code == 503 and busy.json() == {"detail": "0 ingest jobs are queued or running; retry "
                                                                      "once one is done"}
        assert client.delete("/ingest/jobs/ingest-nope").status_code == 404


def test_questions_are_answered_while_a_500_document_job_runs(index):
    """Every question asked while the job runs is answered, and the job is done whole. How long the answers take
    meanwhile: benchmarks/job_latency.py."""
    index.ingest([Document(page_content=t) for t in TEXTS])
    documents = [f"Note {i}: the falcon number {i} hunts over river {i % 7}." for i in range(500)]

    def ask(url: str, i: int) -> str:
        body = json.dumps({"question": f"Which falcon {i}?", "k": 2, "max_new_tokens": 4, "stream": False})
        request = urllib.request.Request(f"{url}/ask", data=body.encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            return json.loads(response.read())["answer"]

    # the index in memory: in a directory, this 2-core CPU's OpenMP threads make the ingest itself 4x slower
    with serve_in_thread(create_app(index, None)) as url, ThreadPoolExecutor(4) as clients:
        submitted = urllib.request.Request(f"{url}/ingest/jobs", data=json.dumps({"documents": documents}).encode(),
                                           headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(submitted, timeout=60) as response:
            job_url = f"{url}{response.headers['Location']}"

        def job() -> dict:
            with urllib.request.urlopen(job_url, timeout=60) as response:
                return json.loads(response.read())

        def ask_while_ingesting(client: int) -> list[str]:  # 10 questions, unless the ingest ends first
            answers = []
            while job()["status"] in ("queued", "running") and len(answers) < 10:
                answers.append(ask(url, client * 1000 + len(answers)))
            return answers

        during = [a for answers in clients.map(ask_while_ingesting, range(4)) for a in answers]
        eventually(lambda: job()["status"] not in ("queued", "running"), "the job ended", timeout_s=600)
        assert (job()["status"], job()["done"], job()["added"]) == ("done", 500, 500)
    assert len(during) >= 20 and all(answer is not None for answer in during)  # every one answered


def test_a_client_that_disconnects_leaves_its_batch(index, slow_steps):
    index.ingest([Document(page_content=t) for t in TEXTS])
    long = {"question": "What does the falcon do?", "k": 1, "max_new_tokens": 400}  # seconds to decode whole
    with serve_in_thread(create_app(index, None)) as url:
        first_line_then_leave(url, long)
        eventually(lambda: pending(url) == 0, "the first answer's slot freed")
        first_line_then_leave(url, long)  # not queued behind the answer nobody reads
        eventually(lambda: pending(url) == 0, "the second answer's slot freed")
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        decoded = len(slow_steps)
        time.sleep(0.5)
        assert len(slow_steps) <= decoded + 1  # at most the step under way: nothing decodes them any more
    assert 'nugget_rag_cancelled_requests_total{reason="disconnect"} 2.0' in metrics
    assert len(slow_steps) < 400  # both answers together: fewer steps than one read whole


@pytest.mark.parametrize("path", ["/ask", "/v1/chat/completions"])
def test_a_client_that_disconnects_before_a_whole_answer_leaves_its_batch(index, slow_steps, path):
    index.ingest([Document(page_content=t) for t in TEXTS])
    body = ({"question": "What does the falcon do?", "max_new_tokens": 400, "stream": False} if path == "/ask"
            else {"messages": [{"role": "user", "content": "What does the falcon do?"}], "max_tokens": 400})
    with serve_in_thread(create_app(index, None)) as url:
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        eventually(lambda: bool(slow_steps), "decoding started")
        assert pending(url) == 1
        connection.close()
        eventually(lambda: pending(url) == 0, "the slot freed")
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
    assert len(slow_steps) < 400  # cut off: fewer steps than the whole answer
    assert 'nugget_rag_cancelled_requests_total{reason="disconnect"} 1.0' in metrics
    assert f'nugget_rag_requests_total{{path="{path}",status="499"}} 1.0' in metrics


def test_an_answer_past_its_deadline_is_cut_off_with_a_504(index, slow_steps):
    index.ingest([Document(page_content=t) for t in TEXTS])
    long = {"question": "What does the falcon do?", "k": 1, "max_new_tokens": 400}
    # 2 s: long enough for the first token on a slow machine (a deadline before it is a plain 504 response),
    # far short of the 8 s the answer takes whole
    with TestClient(create_app(index, None, request_timeout_s=2)) as client:
        lines = [json.loads(line) for line in client.post("/ask", json=long).iter_lines() if line]
        assert "text" in lines[0], lines[0]  # the stream started, then was cut off
        assert lines[-1]["error"]["status"] == 504 and "--request-timeout" in lines[-1]["error"]["message"]
        whole = client.post("/ask", json={**long, "stream": False})
        assert whole.status_code == 504 and "2 s" in whole.json()["detail"]
        decoded = len(slow_steps)
        assert client.get("/health").json()["pending"] == 0
        time.sleep(0.5)
        assert len(slow_steps) == decoded  # no step after the 504s
        assert decoded < 400  # both answers together: fewer steps than one whole (20 ms a step: 100 in 2 s)
        assert 'nugget_rag_cancelled_requests_total{reason="deadline"} 2.0' in client.get("/metrics").text


@pytest.mark.parametrize("path", ["/ask", "/v1/chat/completions"])
def test_a_refused_stream_gets_its_status_before_the_first_byte(client, path):
    client.post("/ingest", json={"documents": TEXTS})
    question = "Which bird? " * 2000  # 24 KB: longer than the tiny model's 512 positions
    body = ({"question": question} if path == "/ask"
            else {"messages": [{"role": "user", "content": question}], "stream": True})
    response = client.post(path, json=body)
    assert response.status_code == 422 and "positions" in response.text
    assert client.get("/health").json()["pending"] == 0


def test_a_failure_mid_stream_ends_it_with_an_error_event(client, monkeypatch):
    client.post("/ingest", json={"documents": TEXTS})
    steps = batching.generation_steps

    def failing(*args, **kwargs):  # the device fails once the answer has begun
        for pieces, done in steps(*args, **kwargs):
            yield pieces, [False] * len(pieces)
            if any(pieces):
                raise RuntimeError("the device fell over")

    monkeypatch.setattr(batching, "generation_steps", failing)
    lines = [json.loads(line) for line in client.post("/ask", json={"question": "Bread?"}).iter_lines() if line]
    assert "text" in lines[0] and lines[-1] == {"error": {"message": "the answer failed: RuntimeError: the device "
                                                          "fell over", "status": 500}}
    events = [e for e in client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Bread?"}],
                                                                   "stream": True}).iter_lines() if e]
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == 500
    assert client.get("/health").json()["pending"] == 0
    assert 'nugget_rag_errors_total{status="500"} 2.0' in client.get("/metrics").text


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/ask", {"question": "Why\ud800?"}, "question"),
    ("/ingest", {"documents": ["fine", "bad \ud800"]}, "documents"),
    ("/ingest", {"documents": [{"page_content": "bad \udfff"}]}, "documents[0].page_content"),
    ("/compress", {"documents": [{"page_content": "fine", "metadata": {"title": "\ud800"}}]}, "documents[0].metadata"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Why\ud800?"}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "text"),
])
def test_text_that_is_not_valid_unicode_gets_a_422_naming_its_field(client, path, body, field):
    client.post("/ingest", json={"documents": TEXTS})
    response = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code == 422 and f"{field} is not valid Unicode" in response.text, response.text
    assert "\\ud800" in response.text or "\\udfff" in response.text  # the text named, escaped


def test_compress_gives_every_input_an_entry_in_order(client):
    documents = client.post("/compress", json={"documents": [TEXTS[0], "   ", "", TEXTS[1]]}).json()["documents"]
    assert len(documents) == 4 and "empty" in documents[1]["skipped"] and "empty" in documents[2]["skipped"]
    assert [documents[i]["metadata"]["nuggets"]["n_tokens"] for i in (0, 3)] == [len(TEXTS[0]), len(TEXTS[1])]


def test_metrics_in_prometheus_format(client):
    from prometheus_client.parser import text_string_to_metric_families

    client.post("/ingest", json={"documents": TEXTS})
    client.post("/ask", json={"question": "Bread?", "max_new_tokens": 3, "finish_sentence": 0, "stream": False})
    client.post("/ask", json={"question": " "})
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(response.text) for s in family.samples}
    assert samples[("nugget_rag_requests_total", (("path", "/ask"), ("status", "200")))] == 1
    assert samples[("nugget_rag_errors_total", (("status", "422"),))] == 1
    assert samples[("nugget_rag_tokens_total", (("direction", "out"),))] == 3
    assert samples[("nugget_rag_nuggets_read_total", (("source", "computed"),))] >= 1  # the passage's text state
    assert samples[("nugget_rag_pending_requests", ())] == 0
    assert samples[("nugget_rag_request_seconds_count", (("path", "/ask"),))] == 2
    assert samples[("nugget_rag_first_token_seconds_count", ())] == 1


KEY = "s3cret-key"


UNAUTHORIZED = {"detail": "this server needs an API key: send the header 'Authorization: Bearer <key>' (a browser "
                         "asks for it: any user name, the key as the password)"}


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", "Bearer", f"Bearer {KEY}x", KEY,
                                           basic(KEY, "wrong"), basic("page", f"{KEY}x"), f"Bearer {basic('', KEY)}"])
def test_a_key_guards_every_path_but_health(index, authorization):
    with TestClient(create_app(index, None, api_key=KEY)) as client:
        headers = {"Authorization": authorization} if authorization else {}
        for method, path in [("POST", "/ask"), ("POST", "/ingest"), ("POST", "/compress"), ("GET", "/metrics"),
                             ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/ingest/jobs"),
                             ("GET", "/ingest/jobs"), ("GET", "/ingest/jobs/ingest-1"),
                             ("DELETE", "/ingest/jobs/ingest-1"), ("GET", "/")]:
            response = client.request(method, path, json={"documents": TEXTS}, headers=headers)
            assert response.status_code == 401 and response.headers.get_list("www-authenticate") == [
                "Bearer", 'Basic realm="nugget-rag", charset="UTF-8"']
            assert KEY not in response.text and response.json() == UNAUTHORIZED
        assert client.get("/health").status_code == 200
        granted = client.post("/ingest", json={"documents": TEXTS}, headers={"Authorization": f"Bearer {KEY}"})
        assert granted.status_code == 200 and len(index) == 2
        assert client.get("/v1/models", headers={"Authorization": basic("anyone", KEY)}).status_code == 200


def test_the_openai_client_talks_to_the_server(index):
    openai = pytest.importorskip("openai")
    index.ingest([Document(page_content=t) for t in TEXTS])
    with serve_in_thread(create_app(index, None, api_key=KEY)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        model = index.compressor.model.base_name
        assert [m.id for m in client.models.list()] == [model]
        question = [{"role": "user", "content": [{"type": "text", "text": "What does the falcon do?"}]}]
        whole = client.chat.completions.create(model=model, messages=question, max_tokens=3)
        assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 3
        chunks = list(client.chat.completions.create(model=model, messages=question, max_completion_tokens=3,
                                                     stream=True))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.UnprocessableEntityError, match="positions"):  # refused before the stream
            list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Why? " * 800}],
                                                stream=True))


def test_ask_url_sends_the_key_from_the_environment(index, monkeypatch, capsys):
    from nugget_rag import cli

    index.ingest([Document(page_content=t) for t in TEXTS])
    ask = ["ask", "Falcons?", "-k", "1", "--max-new-tokens", "2"]
    with serve_in_thread(create_app(index, None, api_key=KEY)) as url:
        monkeypatch.delenv("NUGGET_RAG_API_KEY", raising=False)
        assert cli.main([*ask, "--url", url]) == 2 and "answered 401" in capsys.readouterr().err
        monkeypatch.setenv("NUGGET_RAG_API_KEY", KEY)
        assert cli.main([*ask, "--url", url]) == 0 and "Sources:" in capsys.readouterr().out


PROBE_PASS_S = 0.5  # CPU each probe pass burns under `slow_probe`
PASSAGES = [f"Passage {i}: the mill grinds {i} sacks." for i in range(64)]  # one chunk each: 4 probe passes at k=64


class Steps(list):
    """The times the steps of some work began; `stopped`: for each step that ended, whether its request was to stop
    by then (its client gone, its deadline past)."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped: list[bool] = []

    def slowed(self, real: Callable, cpu_s: float) -> Callable:
        """`real`, recorded here as a step that first burns `cpu_s` of CPU (as much on a busy machine)."""

        def slow(*args, **kwargs):
            self.append(time.monotonic())
            start = time.thread_time()
            while time.thread_time() - start < cpu_s:
                pass
            out = real(*args, **kwargs)
            stop = current_stop()
            self.stopped.append(stop is not None and stop())
            return out

        return slow

    def stopped_at_the_next_step(self) -> bool:
        """Every step began ended, and none began after one that ended with its request to stop."""
        return len(self.stopped) == len(self) and True not in self.stopped[:-1]


@pytest.fixture
def slow_probe(monkeypatch) -> Steps:
    """Each pass of the probe (QueryLikelihood, 16 passages a pass) first burns PROBE_PASS_S of CPU."""
    passes = Steps()
    monkeypatch.setattr(NuggetCompressor, "_likelihood", passes.slowed(NuggetCompressor._likelihood, PROBE_PASS_S))
    return passes


def leave_when(url: str, path: str, body: dict, started: Callable[[], bool]) -> None:
    """Send `body` to `path`, and disconnect once `started()` (and 0.2 s more)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    while not started():
        time.sleep(0.01)
    time.sleep(0.2)
    connection.close()


def test_a_client_that_leaves_during_the_probe_stops_it_and_the_cpu_falls_idle(index, slow_probe):
    index.ingest([Document(page_content=p) for p in PASSAGES])
    with serve_in_thread(create_app(index, None)) as url:
        body = {"question": "How many sacks?", "k": 64, "max_new_tokens": 4, "stream": False}
        leave_when(url, "/ask", body, lambda: bool(slow_probe))
        eventually(lambda: pending(url) == 0, "the slot freed")
        eventually(slow_probe.stopped_at_the_next_step, "the pass under way ended, and no other began")
        cpu = time.process_time()
        time.sleep(1)
        busy = time.process_time() - cpu  # the server's process, every thread, for 1 s once the probe stopped
    assert len(slow_probe) < 4  # cut off: without cancellation, every pass
    assert busy < 0.2  # idle: nothing computes for the answer nobody waits for


def test_a_deadline_on_ask_stops_the_probe(index, slow_probe):
    index.ingest([Document(page_content=p) for p in PASSAGES])
    with TestClient(create_app(index, None, request_timeout_s=1.2)) as client:
        response = client.post("/ask", json={"question": "How many sacks?", "k": 64, "stream": False})
        answered, passes = time.monotonic(), len(slow_probe)
        assert response.status_code == 504 and "1.2 s limit (--request-timeout)" in response.json()["detail"]
        # cut off (4 passes burn 2 s of CPU, past the 1.2 s deadline on any machine) at the first check after the
        # deadline: no pass began once one ended past it, and none after the 504
        assert 1 <= passes < 4 and slow_probe.stopped_at_the_next_step()
        time.sleep(PROBE_PASS_S + 0.2)
        assert len(slow_probe) == passes and max(slow_probe) < answered
        assert 'nugget_rag_cancelled_requests_total{reason="deadline"} 1.0' in client.get("/metrics").text


@pytest.fixture
def slow_compression(monkeypatch) -> Steps:
    """Each batch the encoder compresses first burns 0.3 s of CPU."""
    batches = Steps()
    monkeypatch.setattr(NuggetModel, "compress", batches.slowed(NuggetModel.compress, 0.3))
    return batches


def assert_nothing_half_written(index, tmp_path) -> None:
    """The index is as it was (empty, nothing saved), and every state in the store is whole."""
    assert len(index) == 0 and not (tmp_path / "index.json").exists()
    store = NuggetStore(directory=tmp_path / "nuggets")
    assert all(store.get_by_key(key) is not None for key in store.byte_store.yield_keys())


@pytest.mark.parametrize("path", ["/ingest", "/compress"])
def test_ingest_and_compress_stop_when_their_client_leaves(index, tmp_path, slow_compression, path):
    documents = [f"Document {i} tells of the mill and its {i} sacks." for i in range(40)]  # 5 batches of 8
    with serve_in_thread(create_app(index, tmp_path)) as url:
        leave_when(url, path, {"documents": documents}, lambda: bool(slow_compression))
        eventually(lambda: pending(url) == 0, "the slot freed")
        eventually(slow_compression.stopped_at_the_next_step, "the batch under way ended, and no other began")
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
    assert len(slow_compression) < 5  # cut off: without cancellation, every batch
    assert 'nugget_rag_cancelled_requests_total{reason="disconnect"} 1.0' in metrics
    assert_nothing_half_written(index, tmp_path)


@pytest.mark.parametrize("path", ["/ingest", "/compress"])
def test_ingest_and_compress_stop_at_their_deadline(index, tmp_path, slow_compression, path):
    documents = [f"Document {i} tells of the mill and its {i} sacks." for i in range(40)]
    with TestClient(create_app(index, tmp_path, request_timeout_s=0.5)) as client:
        response = client.post(path, json={"documents": documents})
        assert response.status_code == 504 and "--request-timeout" in response.json()["detail"]
        # cut off (5 batches burn 1.5 s of CPU, past the 0.5 s deadline) at the first check after the deadline
        assert len(slow_compression) < 5 and slow_compression.stopped_at_the_next_step()
        assert client.get("/health").json()["pending"] == 0
    assert_nothing_half_written(index, tmp_path)


def record_of_another_server(store: NuggetStore, silent_s: float) -> str:
    """A job that another server, silent for `silent_s`, recorded as running in `store`: its id."""
    job = IngestJob(id=f"ingest-{'ab' * 16}", status="running", documents=70, done=32, added=30,
                    server="elsewhere:7", created=time.time() - silent_s - 5, heartbeat=time.time() - silent_s)
    JobRecords(store).put(job)
    return job.id


def test_ingest_jobs_live_in_the_store_and_outlive_their_server(index, tmp_path, monkeypatch):
    with TestClient(create_app(index, tmp_path)) as first:
        done_id = first.post("/ingest/jobs", json={"documents": TEXTS}).json()["id"]
        assert wait_for_job(first, done_id)["status"] == "done"
        more = [f"More {i} on rivers." for i in range(70)]
        hold(index.embeddings, monkeypatch, more[32:])  # its second step ends when the server stops
        running = first.post("/ingest/jobs", json={"documents": more}).json()
        eventually(lambda: first.get(f"/ingest/jobs/{running['id']}").json()["done"] > 0, "the first step landed")
        with TestClient(create_app(index, tmp_path)) as second:  # another server over the same store
            seen = second.get(f"/ingest/jobs/{running['id']}").json()
            assert seen["status"] == "running" and seen["done"] >= 32 and seen["server"] == running["server"]
            assert second.delete(f"/ingest/jobs/{running['id']}").status_code == 409  # not its job to cancel
            assert [j["id"] for j in second.get("/ingest/jobs").json()["jobs"]] == [done_id, running["id"]]
    # the first server stopped with its job under way: a restarted one reports it interrupted, and what it added
    store = index.compressor.store
    with TestClient(create_app(index, tmp_path)) as restarted:
        jobs = restarted.get("/ingest/jobs").json()["jobs"]
        assert [(j["id"], j["status"]) for j in jobs] == [(done_id, "done"), (running["id"], "interrupted")]
        assert 32 <= jobs[1]["done"] < 70 and "send the rest again" in jobs[1]["error"]
        silent = record_of_another_server(store, 60)
        assert restarted.get(f"/ingest/jobs/{silent}").json()["status"] == "interrupted"  # silent for 60 s: gone
        JobRecords(store).delete([silent])
        alive = record_of_another_server(store, 1)
        assert restarted.get(f"/ingest/jobs/{alive}").json()["status"] == "running"  # heard from 1 s ago
    assert sorted(p.name for p in (tmp_path / "nuggets" / "jobs").iterdir()) == sorted(
        [f"{i}.json" for i in (done_id, running["id"], alive)] + [running["id"]])  # its documents, to resume
    assert all(len(key) == 64 for key in store.byte_store.yield_keys())  # the records are no nugget keys


STOPPED_MID_JOB = """
import sys, threading, time
import torch
sys.path.insert(0, sys.argv[1])
from fastapi.testclient import TestClient
from test_integrations import HashEmbeddings
from tiny import tiny_nugget_model
from nugget_rag import NuggetCompressor, NuggetModel, NuggetStore
from nugget_rag.integrations import NuggetIndex
from nugget_rag.serving import create_app

real, steps = NuggetModel.compress, []


def busy(*args, **kwargs):  # each batch first computes in torch for 0.5 s
    steps.append(time.monotonic())
    x, start = torch.randn(128, 128), time.monotonic()
    while time.monotonic() - start < 0.5:
        torch.mm(x, x)
    return real(*args, **kwargs)


NuggetModel.compress = busy
model = tiny_nugget_model()
index = NuggetIndex(NuggetCompressor(model=model, store=NuggetStore()), HashEmbeddings(), chunk_overlap=0)
with TestClient(create_app(index, None)) as client:
    client.post("/ingest/jobs", json={"documents": [f"Note {i} on the mill." for i in range(200)]})
    while not steps:
        time.sleep(0.01)
alive = [t.name for t in threading.enumerate() if t.name.startswith("ingest-jobs")]
print("job threads after the server stopped:", alive)
"""


def test_a_server_stopped_mid_job_waits_for_its_step_and_the_process_exits_cleanly(tmp_path):
    """A job's thread still computing in torch while Python exits aborts the process (exit status 134, "terminate
    called without an active exception"): a stopping server waits for its job's step under way."""
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([sys.executable, "-c", STOPPED_MID_JOB, str(Path(__file__).parent)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "job threads after the server stopped: []" in run.stdout, run.stdout

"""`nugget-rag serve` on the tiny model and hash embeddings: endpoints, streaming, bad input, load."""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra")
from fastapi.testclient import TestClient  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from test_integrations import HashEmbeddings  # noqa: E402
from tiny import tiny_base  # noqa: E402

from nugget_rag import NuggetCompressor, NuggetConfig, NuggetModel, NuggetStore  # noqa: E402
from nugget_rag.integrations import NuggetIndex  # noqa: E402
from nugget_rag.server import create_app  # noqa: E402

TEXTS = ["The falcon hunts over the river valley and dives at great speed.",
         "Sourdough bread needs flour, water, salt and a starter culture."]


@pytest.fixture
def index(tmp_path):
    model = NuggetModel(tiny_base(), NuggetConfig(ratio=4, scorer_layer=2, lora={"rank": 4}))
    compressor = NuggetCompressor(model=model, store=NuggetStore(directory=tmp_path / "nuggets"))
    return NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=0)


@pytest.fixture
def client(index, tmp_path):
    with TestClient(create_app(index, tmp_path, max_pending=4, max_body_bytes=100_000)) as client:
        yield client


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


def test_compress_returns_nugget_metadata(client):
    documents = client.post("/compress", json={"documents": TEXTS}).json()["documents"]
    assert [d["metadata"]["nuggets"]["n_tokens"] for d in documents] == [len(t) for t in TEXTS]


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
    for _ in range(100):  # the server notices the closed stream
        if client.get("/health").json()["pending"] == 0:
            break
        time.sleep(0.05)
    assert client.get("/health").json()["pending"] == 0


def test_200_requests_from_8_clients_all_succeed(index, tmp_path):
    import socket

    import uvicorn

    index.ingest([Document(page_content=t) for t in TEXTS])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(index, None, max_pending=64), port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def ask(i: int) -> float:
        start = time.perf_counter()
        body = json.dumps({"question": f"Question {i}?", "k": 1, "max_new_tokens": 2, "stream": i % 2 == 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/ask", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200 and response.read()
        return time.perf_counter() - start

    try:
        with ThreadPoolExecutor(8) as pool:
            latencies = sorted(pool.map(ask, range(200)))
    finally:
        server.should_exit = True
        thread.join(10)
    assert len(latencies) == 200
    print(f"200 requests, 8 clients: p50 {statistics.median(latencies) * 1000:.0f} ms, "
          f"p95 {latencies[189] * 1000:.0f} ms")


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
    assert text == whole["choices"][0]["message"]["content"] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "hi"}]}).status_code == 422
    assert client.get("/health").json()["pending"] == 0


def test_ingest_keeps_what_another_process_added_to_the_index_meanwhile(client, index, tmp_path):
    client.post("/ingest", json={"documents": [TEXTS[0]]})
    with NuggetIndex.updating(tmp_path, index.compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=0) as other:
        other.ingest([Document(page_content="Written by another process.")])
    assert client.post("/ingest", json={"documents": [TEXTS[1]]}).json() == {"added": 1, "chunks": 3}
    saved = NuggetIndex.load(tmp_path, index.compressor, HashEmbeddings())
    assert len(saved) == 3

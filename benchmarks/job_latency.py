"""Question latency while a background ingest job runs: `nugget-rag serve` (create_app under uvicorn, in this
process) over an in-memory index, questions from `--clients` clients, first with the server idle, then while a
`--documents`-document job (POST /ingest/jobs) runs on its lower-priority thread.

    python benchmarks/job_latency.py [--documents 500] [--clients 4] [--idle 40] [--during 10] [--runs 3]
                                     [--store redis://127.0.0.1:6379/0 | DIR] [--model tiny|default]
                                     [--out benchmarks/results/job-latency]

With `--store`, the server serves the index published in that nugget store (as `nugget-rag serve --store` does:
each job step publishes a version, verified before its commit), under a name of its own each run; without it, an
index in memory.

The model is the tests' tiny random LLaMA shape on SmolLM2's tokenizer (benchmarks/store_scale.py), retrieval by
hashed words: an answer costs what the server's path costs, so the figure is how much the job slows that path
(`--model default`: SmolLM2-135M-Instruct with the shipped checkpoint, where compression and decoding share the
CPU). Each run is a fresh server: `--idle` non-streamed /ask (k = 2, at most 4 new tokens) from the clients, then
the job, and each client asks up to `--during` questions while it is queued or running. Reported per run: p50/p95
latency idle and during the job, their ratios, the questions asked during it, how long the job took, and (a
published index) the versions the server loaded itself rather than took from the job's own publish. Figures from
one run compare within it: a shared CPU's load moves both.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from langchain_core.documents import Document

from nugget_rag import NuggetCompressor, NuggetStore
from nugget_rag.integrations import NuggetIndex
from nugget_rag.integrations.published.index import PublishedIndex
from nugget_rag.integrations.published.publishing import PublishOptions
from nugget_rag.model.checkpoint_files import DEFAULT_CHECKPOINT
from nugget_rag.serving import create_app, serve_in_thread
from nugget_rag.state.store import StoreLocation

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_out_option, made_by, run_meta, table, write_report  # noqa: E402
from store_scale import WordHashEmbeddings, tiny_model  # noqa: E402

TEXTS = ["The falcon hunts over the river valley and dives at great speed.",
         "Sourdough bread needs flour, water, salt and a starter culture."]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=120) as response:
        return json.loads(response.read())


def post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def ask(url: str, i: int) -> float:
    """One non-streamed question: its latency in seconds."""
    request = post(f"{url}/ask", {"question": f"Which falcon {i}?", "k": 2, "max_new_tokens": 4, "stream": False})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        if response.status != 200 or json.loads(response.read())["answer"] is None:
            raise RuntimeError(f"question {i} got {response.status} and no answer")
    return time.perf_counter() - start


def p95(latencies: list[float]) -> float:
    return statistics.quantiles(latencies, n=20)[-1]


def served_index(store: str | None, cache: Path, model: str) -> NuggetIndex | PublishedIndex:
    """The index the server answers over: in memory, or published in `store` under a new name, holding TEXTS; its
    model the tiny one, or the default (SmolLM2-135M-Instruct and the shipped checkpoint)."""
    settings = {"chunk_tokens": 64, "chunk_overlap": 0}
    nuggets = NuggetStore() if store is None else StoreLocation.parse(store).open()
    if model == "tiny":
        compressor = NuggetCompressor(model=tiny_model(), store=nuggets)
    else:
        compressor = NuggetCompressor.from_pretrained(DEFAULT_CHECKPOINT, store=nuggets, device="cpu")
    if store is None:
        index = NuggetIndex(compressor, WordHashEmbeddings(), **settings)
    else:
        index = PublishedIndex(compressor, WordHashEmbeddings(), PublishOptions(name=f"bench-{uuid.uuid4().hex[:8]}"),
                               cache_dir=cache, **settings)
    index.ingest([Document(page_content=t) for t in TEXTS])
    return index


def one_run(documents: int, clients: int, idle_questions: int, during_each: int, store: str | None,
            model: str) -> dict:
    """Idle latencies, then latencies while a `documents`-document job runs, on a fresh server."""
    with tempfile.TemporaryDirectory() as cache:
        return measured(served_index(store, Path(cache), model), documents, clients, idle_questions, during_each)


class Loads(logging.Handler):
    """Counts the versions a published index loaded itself (a question that found the pointer moved before the job's
    publish handed it its new version)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("loaded version")


def measured(index: NuggetIndex | PublishedIndex, documents: int, clients: int, idle_questions: int,
             during_each: int) -> dict:
    run = uuid.uuid4().hex[:6]  # texts of this run only: a shared store holds no state of them yet
    notes = [f"Note {i} of {run}: the falcon number {i} hunts over river {i % 7}." for i in range(documents)]
    loads, logger = Loads(), logging.getLogger(PublishedIndex.__module__)
    logger.setLevel(logging.INFO)
    logger.addHandler(loads)
    with serve_in_thread(create_app(index, None)) as url, ThreadPoolExecutor(clients) as pool:
        idle = list(pool.map(lambda i: ask(url, i), range(idle_questions)))
        with urllib.request.urlopen(post(f"{url}/ingest/jobs", {"documents": notes}), timeout=120) as response:
            job_url = f"{url}{response.headers['Location']}"
        submitted = time.perf_counter()

        def while_running(client: int) -> list[float]:
            latencies = []
            while get(job_url)["status"] in ("queued", "running") and len(latencies) < during_each:
                latencies.append(ask(url, client * 1000 + len(latencies)))
            return latencies

        during = [t for latencies in pool.map(while_running, range(clients)) for t in latencies]
        while (job := get(job_url))["status"] in ("queued", "running"):
            time.sleep(0.1)
        job_s = time.perf_counter() - submitted
    logger.removeHandler(loads)
    if job["status"] != "done" or job["done"] != documents:
        raise RuntimeError(f"the job ended {job['status']} at {job['done']} of {documents} documents: {job['error']}")
    if len(during) < 2:
        raise RuntimeError(f"only {len(during)} questions were asked while the job ran: give more --documents")
    return {"idle": len(idle), "idle_p50_ms": 1000 * statistics.median(idle), "idle_p95_ms": 1000 * p95(idle),
            "during": len(during), "during_p50_ms": 1000 * statistics.median(during),
            "during_p95_ms": 1000 * p95(during), "p50_ratio": statistics.median(during) / statistics.median(idle),
            "p95_ratio": p95(during) / p95(idle), "job_s": job_s, "loads": loads.count}


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [*made_by(meta, f"{meta['torch_threads']} torch threads, load average {meta['load_before']} before",
                      meta["setup"]), "",
             *table(["run", "idle questions", "idle p50 ms", "idle p95 ms", "questions during the job",
                     "during p50 ms", "during p95 ms", "p50 during / idle", "p95 during / idle", "job s",
                     "versions loaded by questions"],
                    ([i, row["idle"], f"{row['idle_p50_ms']:.0f}", f"{row['idle_p95_ms']:.0f}", row["during"],
                      f"{row['during_p50_ms']:.0f}", f"{row['during_p95_ms']:.0f}", f"{row['p50_ratio']:.2f}x",
                      f"{row['p95_ratio']:.2f}x", f"{row['job_s']:.1f}", row["loads"]]
                     for i, row in enumerate(report["runs"], 1)))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=500, help="documents in the job (default 500)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--idle", type=int, default=40, help="questions asked before the job (default 40)")
    parser.add_argument("--during", type=int, default=10, help="most questions a client asks during the job")
    parser.add_argument("--runs", type=int, default=3, help="fresh servers, one after the other (default 3)")
    parser.add_argument("--store", help="serve the index published in this nugget store (a Redis URL, or a "
                        "directory); default: an index in memory")
    parser.add_argument("--model", choices=["tiny", "default"], default="tiny", help="the tests' tiny model (an "
                        "answer costs the server's path), or the default one (SmolLM2-135M-Instruct)")
    add_out_option(parser)
    args = parser.parse_args(argv)
    if min(args.documents, args.clients, args.idle, args.during, args.runs) < 1:
        parser.error("--documents, --clients, --idle, --during and --runs must each be at least 1")
    meta = run_meta(command=shlex.join(["python", "benchmarks/job_latency.py", *(argv or sys.argv[1:])]),
                    torch_threads=torch.get_num_threads(),
                    setup=f"{args.clients} clients, a {args.documents}-document job, {args.model} model, hashed-word "
                          "retrieval, " + ("an index in memory" if args.store is None else "the index published in "
                                           "the store"))
    report = {"meta": meta, "runs": []}
    for run in range(args.runs):
        report["runs"].append(one_run(args.documents, args.clients, args.idle, args.during, args.store, args.model))
        print(f"run {run + 1}: {report['runs'][-1]}", flush=True)
    write_report(args.out, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

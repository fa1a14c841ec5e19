"""Question latency while a background ingest job runs: `nugget-rag serve` (create_app under uvicorn, in this
process) over an in-memory index, questions from `--clients` clients, first with the server idle, then while a
`--documents`-document job (POST /ingest/jobs) runs on its lower-priority thread.

    python benchmarks/job_latency.py [--documents 500] [--clients 4] [--idle 40] [--during 10] [--runs 3]
                                     [--out benchmarks/results/job-latency]

The model is the tests' tiny random LLaMA shape on SmolLM2's tokenizer (benchmarks/store_scale.py), retrieval by
hashed words: an answer costs what the server's path costs, so the figure is how much the job slows that path. Each
run is a fresh server: `--idle` non-streamed /ask (k = 2, at most 4 new tokens) from the clients, then the job, and
each client asks up to `--during` questions while it is queued or running. Reported per run: p50/p95 latency idle
and during the job, their ratio, the questions asked during it and how long the job took. Figures from one run
compare within it: a shared CPU's load moves both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import torch
from langchain_core.documents import Document

from nugget_rag import NuggetCompressor, NuggetStore
from nugget_rag.integrations import NuggetIndex
from nugget_rag.serving import create_app, serve_in_thread

sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def one_run(documents: int, clients: int, idle_questions: int, during_each: int) -> dict:
    """Idle latencies, then latencies while a `documents`-document job runs, on a fresh server."""
    index = NuggetIndex(NuggetCompressor(model=tiny_model(), store=NuggetStore()), WordHashEmbeddings(),
                        chunk_tokens=64, chunk_overlap=0)
    index.ingest([Document(page_content=t) for t in TEXTS])
    notes = [f"Note {i}: the falcon number {i} hunts over river {i % 7}." for i in range(documents)]
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
    if job["status"] != "done" or job["done"] != documents:
        raise RuntimeError(f"the job ended {job['status']} at {job['done']} of {documents} documents: {job['error']}")
    if len(during) < 2:
        raise RuntimeError(f"only {len(during)} questions were asked while the job ran: give more --documents")
    return {"idle": len(idle), "idle_p50_ms": 1000 * statistics.median(idle), "idle_p95_ms": 1000 * p95(idle),
            "during": len(during), "during_p50_ms": 1000 * statistics.median(during),
            "during_p95_ms": 1000 * p95(during), "p95_ratio": p95(during) / p95(idle), "job_s": job_s}


def markdown(report: dict) -> str:
    lines = [f"- {report['date']}, {report['machine']}; {report['setup']}", "",
             "| run | idle questions | idle p50 ms | idle p95 ms | questions during the job | during p50 ms | "
             "during p95 ms | p95 during / idle | job s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(report["runs"], 1):
        lines.append(f"| {i} | {row['idle']} | {row['idle_p50_ms']:.0f} | {row['idle_p95_ms']:.0f} | {row['during']} "
                     f"| {row['during_p50_ms']:.0f} | {row['during_p95_ms']:.0f} | {row['p95_ratio']:.2f}x "
                     f"| {row['job_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=500, help="documents in the job (default 500)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--idle", type=int, default=40, help="questions asked before the job (default 40)")
    parser.add_argument("--during", type=int, default=10, help="most questions a client asks during the job")
    parser.add_argument("--runs", type=int, default=3, help="fresh servers, one after the other (default 3)")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)
    if min(args.documents, args.clients, args.idle, args.during, args.runs) < 1:
        parser.error("--documents, --clients, --idle, --during and --runs must each be at least 1")
    report = {"command": shlex.join(["python", "benchmarks/job_latency.py", *(argv or sys.argv[1:])]),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
                         f"load average {os.getloadavg()[0]:.1f} before",
              "setup": f"{args.clients} clients, a {args.documents}-document job, tiny model, hashed-word retrieval",
              "runs": []}
    for run in range(args.runs):
        report["runs"].append(one_run(args.documents, args.clients, args.idle, args.during))
        print(f"run {run + 1}: {report['runs'][-1]}", flush=True)
    text = markdown(report)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(f"    {report['command']}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

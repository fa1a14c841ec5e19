"""Serving throughput: questions/s with concurrent clients, decoding batched (the server's BatchedGenerator) or one
request at a time, reading nuggets or Full's prompt, in one run.

    python benchmarks/serve_throughput.py [--clients 8] [--questions 32] [--max-new-tokens 32] [--threads 2]
    python benchmarks/serve_throughput.py --http [--requests 200] [--clients 8] [--disconnect 0.1] [--rounds 4]
    python benchmarks/serve_throughput.py --http --ray --replicas 1 2 [--requests 48] [--clients 8]

Each client asks SQuAD dev questions about their own passage (../shared/data; nuggets compressed beforehand, as a
warm server holds them), greedy, `max-new-tokens` at most. Reports questions/s, generated tokens/s and p50/p95
latency per setting, and the ratios against Full one at a time; on a CPU also batched nuggets with int8 weights
(`NuggetModel.merged_format`).

--http: the bounded load test of `nugget-rag serve` itself (default model, a fresh index of the questions' passages
sent through POST /ingest), from `--clients` clients over loopback, in two arms of `--requests` streamed /ask
requests each: every client reads its answer to the end, or `--disconnect` of the requests (every 10th at 0.1) ask
for a long answer and disconnect after its first line. The arms alternate in `--rounds` parts, so that a shared
CPU's load falls on both alike. Reports, per arm, errors (a status other than 200, or an error line) and p50/p95
latency among the requests that stayed, first-line latency, the server's pending requests 2 s after each part (the
most) and the answers it cancelled.

--http --ray: `nugget-rag serve --ray --replicas N` (a local Ray of this machine's CPUs, one CPU and one torch thread
a replica, the nuggets in a Redis started for the run) for each N of `--replicas` in turn, over one index: the
passages are ingested through the first (on Ray Data), the later ones open it. The same `--requests` streamed /ask
requests from `--clients` clients each; reports questions/s, errors and p50/p95 latency per N, and the ratio to the
first N.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent / "tests")]

from redis_server import RedisServer, free_port, missing  # noqa: E402
from reporting import add_out_option, made_by, run_meta, table, write_report  # noqa: E402

from nugget_rag import NuggetModel  # noqa: E402
from nugget_rag.config import DECODER  # noqa: E402
from nugget_rag.corpora import read_squad  # noqa: E402
from nugget_rag.generation import GenerationSettings  # noqa: E402
from nugget_rag.generation.batching import BatchedGenerator  # noqa: E402
from nugget_rag.prompts import QA_PROMPT, chat_token_ids, full_context_messages  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad-dev-v1.1.json"


def run(batcher: BatchedGenerator, requests: list[tuple], clients: int, settings: GenerationSettings) -> dict:
    latencies, tokens, lock = [], [0], threading.Lock()
    todo = iter(requests)

    def client():
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            states, prompt, prefix, adapter = item
            start = time.perf_counter()
            steps = list(batcher.stream(states, prompt, settings, prefix=prefix, adapter=adapter))
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens[0] += len(steps)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    return {"questions_per_s": len(latencies) / wall, "tokens_per_s": tokens[0] / wall,
            "p50_s": statistics.median(latencies), "p95_s": latencies[int(0.95 * (len(latencies) - 1))],
            "mean_batch": statistics.mean(batcher.batch_sizes)}


def ask_once(port: int, question: str, max_new_tokens: int, leave: bool) -> dict:
    """One streamed /ask: its status, whether it ended with an error line, its latency and first-line latency; `leave`:
    disconnect after the first line."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    try:
        body = json.dumps({"question": question, "k": 2, "max_new_tokens": max_new_tokens})
        connection.request("POST", "/ask", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return {"status": response.status, "error": True, "left": leave}
        first = time.perf_counter() - start
        lines = [json.loads(response.readline())]
        if not leave:
            lines += [json.loads(line) for line in response if line.strip()]
        return {"status": 200, "error": any("error" in line for line in lines), "left": leave, "first_s": first,
                "latency_s": time.perf_counter() - start}
    finally:
        connection.close()


def server_state(port: int) -> tuple[int, float]:
    """The server's pending requests and the answers it has cancelled so far."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as response:
        pending = json.loads(response.read())["pending"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
        cancelled = sum(float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                        if line.startswith("nugget_rag_cancelled_requests_total"))
    return pending, cancelled


def http_main(args: argparse.Namespace) -> int:
    records = read_squad(args.data, "dev")[: args.requests]
    passages = list(dict.fromkeys(r["context"] for r in records))[: args.passages]
    questions = [r["question"] for r in records if r["context"] in passages]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as index_dir:
        command = [sys.executable, "-m", "nugget_rag.cli", "serve", "--index", index_dir, "--port", str(port)]
        server = subprocess.Popen(command)
        try:
            for _ in range(600):
                try:
                    server_state(port)
                    break
                except OSError:
                    time.sleep(0.5)
            ingest = urllib.request.Request(f"http://127.0.0.1:{port}/ingest",
                                            data=json.dumps({"documents": passages}).encode(),
                                            headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(ingest, timeout=3600) as response:
                print(f"ingested {len(passages)} passages: {json.loads(response.read())}", flush=True)
            every = round(1 / args.disconnect)
            arms = {"all read to the end": lambda i: False, f"1 in {every} disconnects": lambda i: i % every == 0}
            results: dict[str, list[dict]] = {name: [] for name in arms}
            pending, cancelled = dict.fromkeys(arms, 0), dict.fromkeys(arms, 0.0)
            per_round = args.requests // args.rounds
            for part in range(args.rounds):
                for name, leaves in arms.items():
                    numbers = range(part * per_round, (part + 1) * per_round)

                    def one(i: int) -> dict:
                        leave = leaves(i)
                        return ask_once(port, questions[i % len(questions)],
                                        args.long_tokens if leave else args.max_new_tokens, leave)

                    before = server_state(port)[1]
                    with ThreadPoolExecutor(args.clients) as pool:
                        results[name] += pool.map(one, numbers)
                    time.sleep(2)  # the server notices the last disconnects
                    now_pending, now_cancelled = server_state(port)
                    pending[name] = max(pending[name], now_pending)
                    cancelled[name] += now_cancelled - before
        finally:
            server.terminate()
            server.wait(60)
    def arm(name: str, rows: list[dict]) -> list:
        stayed = [r for r in rows if not r["left"]]
        latencies = sorted(r["latency_s"] for r in stayed if "latency_s" in r)
        p95 = latencies[int(0.95 * (len(latencies) - 1))] if latencies else float("nan")
        return [name, len(stayed), sum(r["error"] for r in stayed), f"{statistics.median(latencies):.2f}", f"{p95:.2f}",
                f"{statistics.median(r['first_s'] for r in rows if 'first_s' in r):.2f}", len(rows) - len(stayed),
                pending[name], f"{cancelled[name]:g}"]

    meta = run_meta()
    lines = [*made_by(meta, f"{args.requests} streamed /ask requests per arm, {args.clients} clients, <= "
                      f"{args.max_new_tokens} new tokens (those that disconnect ask for {args.long_tokens}), k = 2, "
                      f"{len(passages)} SQuAD dev passages, arms alternating in {args.rounds} rounds"), "",
             *table(["arm", "stayed", "errors among them", "p50 latency (s)", "p95 latency (s)", "p50 first line (s)",
                     "left", "pending 2 s after (most)", "cancelled"], (arm(n, rows) for n, rows in results.items()))]
    write_report(args.out, {"meta": meta, "arms": results, "pending": pending, "cancelled": cancelled},
                 "\n".join(lines) + "\n")
    return 0


def start_server(command: list[str], port: int) -> subprocess.Popen:
    """`command` started, once its /health answers on `port`."""
    server = subprocess.Popen(command)
    for _ in range(1200):
        if server.poll() is not None:
            raise RuntimeError(f"{' '.join(command)} exited with {server.returncode}")
        try:
            server_state(port)
            return server
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{' '.join(command)} did not answer in 10 minutes")


def ingest(port: int, passages: list[str]) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/ingest", data=json.dumps({"documents": passages}).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as response:
        print(f"ingested {len(passages)} passages in {time.perf_counter() - started:.1f} s: "
              f"{json.loads(response.read())}", flush=True)


@contextmanager
def redis_server(directory: str | Path) -> Iterator[str]:
    """A redis-server of its own (no persistence, its files in `directory`) while the block runs; yields its URL."""
    if reason := missing():
        raise SystemExit(f"this benchmark needs a Redis server for its shared store: {reason}")
    server = RedisServer(Path(directory), persist=False)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def measure_requests(port: int, questions: list[str], requests: int, clients: int, max_new_tokens: int,
                     warm: int) -> dict:
    """`warm` answers first (unmeasured), then `requests` streamed /ask of `questions` in turn from `clients` clients:
    answered questions/s, errors, wall time and p50/p95 latency of the answered."""
    with ThreadPoolExecutor(warm) as pool:
        list(pool.map(lambda i: ask_once(port, questions[i % len(questions)], 8, False), range(warm)))
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda i: ask_once(port, questions[i % len(questions)], max_new_tokens, False),
                                range(requests)))
    wall = time.perf_counter() - started
    latencies = sorted(r["latency_s"] for r in results if not r["error"])
    if not latencies:
        raise RuntimeError(f"none of the {requests} requests to port {port} was answered")
    return {"per_s": len(latencies) / wall, "errors": len(results) - len(latencies), "wall": wall,
            "p50": statistics.median(latencies), "p95": latencies[int(0.95 * (len(latencies) - 1))]}


def ray_main(args: argparse.Namespace) -> int:
    records = read_squad(args.data, "dev")[: args.requests]
    passages = list(dict.fromkeys(r["context"] for r in records))[: args.passages]
    questions = [r["question"] for r in records if r["context"] in passages]
    rows = {}
    with tempfile.TemporaryDirectory() as work, redis_server(work) as redis_url:
        for replicas in args.replicas:
            port = free_port()
            command = [sys.executable, "-m", "nugget_rag.cli", "serve", "--index", f"{work}/index", "--port",
                       str(port), "--store", redis_url, "--ray", "--replicas", str(replicas)]
            server = start_server(command, port)
            try:
                if replicas == args.replicas[0]:
                    ingest(port, passages)
                # warm: every replica's first answers
                rows[replicas] = measure_requests(port, questions, args.requests, args.clients, args.max_new_tokens,
                                                  warm=2 * replicas)
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(120)
            print(f"{replicas} replicas: {rows[replicas]}", flush=True)
    meta = run_meta()
    base = rows[args.replicas[0]]["per_s"]
    lines = [*made_by(meta, f"{args.requests} streamed /ask requests per setting, {args.clients} clients, <= "
                      f"{args.max_new_tokens} new tokens, k = 2, {len(passages)} SQuAD dev passages, default model, "
                      "one CPU and one torch thread a replica"), "",
             *table(["replicas", "answered questions/s", "x first", "errors", "wall (s)", "p50 latency (s)",
                     "p95 latency (s)"],
                    ([replicas, f"{r['per_s']:.3f}", f"{r['per_s'] / base:.2f}x", r["errors"], f"{r['wall']:.1f}",
                      f"{r['p50']:.2f}", f"{r['p95']:.2f}"] for replicas, r in rows.items()))]
    write_report(args.out, {"meta": meta, "replicas": rows}, "\n".join(lines) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--http", action="store_true", help="load-test `nugget-rag serve` over HTTP (see above)")
    parser.add_argument("--requests", type=int, default=200, help="--http: requests per arm")
    parser.add_argument("--disconnect", type=float, default=0.1, help="--http: the share of requests that leave")
    parser.add_argument("--long-tokens", type=int, default=300, help="--http: max_new_tokens of those that leave")
    parser.add_argument("--rounds", type=int, default=4, help="--http: parts the arms alternate in")
    parser.add_argument("--passages", type=int, default=32, help="--http: SQuAD dev passages in the index")
    parser.add_argument("--ray", action="store_true", help="--http: serve from Ray Serve replicas (see above)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="--http --ray: replica counts")
    add_out_option(parser)
    args = parser.parse_args()
    if args.http and args.ray:
        return ray_main(args)
    if args.http:
        return http_main(args)
    torch.set_num_threads(args.threads)
    model = NuggetModel.from_pretrained("default")
    tok = model.tokenizer
    records = read_squad(args.data, "dev")[: args.questions]
    with torch.inference_mode():
        states = model.compress([tok(r["context"], add_special_tokens=False)["input_ids"] for r in records])
    nugget, full = [], []
    for record, state in zip(records, states):
        instruction = QA_PROMPT.format(question=record["question"])
        prefix, prompt = model.chat_prompt([{"role": "user", "content": instruction}])
        nugget.append(([state], prompt, prefix, DECODER))
        full.append(([], chat_token_ids(tok, full_context_messages([record["context"]], instruction)), [], None))
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    rows = {}
    settings_rows = [("Full, one at a time", full, 1, "float"), ("Full, batched", full, args.clients, "float"),
                     ("nugget-rag, one at a time", nugget, 1, "float"),
                     ("nugget-rag, batched", nugget, args.clients, "float")]
    if model.device.type == "cpu":
        settings_rows.append(("nugget-rag, batched, int8 weights", nugget, args.clients, "int8"))
    for name, requests, batch, weights in settings_rows:
        model.merged_format = weights
        rows[name] = run(BatchedGenerator(model, max_batch=batch), requests, args.clients, settings)
    base = rows["Full, one at a time"]["questions_per_s"]
    meta = run_meta()
    lines = [*made_by(meta, f"{args.questions} SQuAD dev questions, {args.clients} clients, <= {args.max_new_tokens} "
                      f"new tokens, {args.threads} threads, {model.device}, r = {model.config.ratio:g}"), "",
             *table(["setting", "questions/s", "x Full one at a time", "tokens/s", "p50 latency (s)", "p95 latency (s)",
                     "mean batch"],
                    ([name, f"{r['questions_per_s']:.2f}", f"{r['questions_per_s'] / base:.2f}x",
                      f"{r['tokens_per_s']:.1f}", f"{r['p50_s']:.1f}", f"{r['p95_s']:.1f}", f"{r['mean_batch']:.1f}"]
                     for name, r in rows.items()))]
    write_report(args.out, {"meta": meta, "settings": rows}, "\n".join(lines) + "\n")
    return 0

if __name__ == "__main__":
    sys.exit(main())

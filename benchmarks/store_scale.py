"""Nugget stores at scale: N passages (default 100,000) ingested with a tiny model into a directory and into Redis
(store bytes, ingest rate), then the Redis index served by one process and by 1 and 2 Ray Serve replicas (query
p50/p95 latency), in one run.

    python benchmarks/store_scale.py [--passages 100000] [--embeddings hash|minilm] [--replicas 1 2]
                                     [--requests 400] [--clients 4] [--max-new-tokens 16]
                                     [--out benchmarks/results/store-scale]

Passages: synthetic and seeded (passage i is the same text for any --passages), 3 to 6 sentences of invented facts,
60 to 133 tokens (5th to 95th percentile; 97 on average); a passage's question asks who did what its first sentence
says. The model is the tests' tiny random LLaMA shape (4 layers, width 32, 2 key/value heads of 8; tests/tiny.py) on
SmolLM2's tokenizer, so the token counts are real ones and the states small: untrained adapters, r = 10, the default
floor (keep_ratio 4), bfloat16 states. Retrieval embeddings: `hash` (default), each word hashed into 256
dimensions, about free, so that the rates are the store's and the model's; or all-MiniLM-L6-v2 (`minilm`), the
default of `nugget-rag`.

Ingest: `NuggetIndex.ingest` (batches of --batch-size), then `save`, into (a) a directory store (the index's
nuggets/) and (b) a Redis started for the run, each a new index, so that every passage is compressed. Reported per
store: passages, tokens, store bytes (directory: the files' bytes and the disk blocks they take; Redis: the values'
summed STRLEN, and the growth of `INFO memory` used_memory), bytes a token, passages/s and tokens/s, and how the
ingest's time splits: splitting into chunks (the text splitter measures its pieces with the tokenizer), the model's
compress passes, the retrieval embeddings, the store's writes, and the rest (tokenising, serialising states, FAISS
and the docstore); and the seconds a passage spent splitting.

Queries: the Redis index served by the single-process server (create_app under uvicorn in its own process, one torch
thread) and by `serve_index` (what `nugget-rag serve --ray --replicas N` runs: a local Ray of this machine's CPUs,
one CPU and one torch thread a replica) for each N of --replicas. Each gets --requests streamed /ask (k = 2, at most
--max-new-tokens new tokens, greedy) of the same questions in turn from --clients clients over loopback, after 2
warm-up answers a replica: questions/s, errors, p50/p95 latency, and the ratios to the first Ray row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from nugget_rag import NuggetCompressor, NuggetConfig, NuggetModel, NuggetStore
from nugget_rag.integrations import NuggetIndex, embedding_name, minilm_embeddings
from nugget_rag.integrations.local.files import NUGGETS_DIR
from nugget_rag.model.base_model import convert_default_model, prepare_base_model

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_out_option, run_meta, table, write_report  # noqa: E402
from serve_throughput import free_port, measure_requests, redis_server, start_server  # noqa: E402

REDIS_NAMESPACE = "nugget-rag"
NAMES = ("Ada Abbott, Bela Brandt, Carlos Castillo, Dana Dubois, Emil Eriksen, Farah Fontaine, Goran Garcia, "
         "Hana Holm, Ivo Ibsen, Jana Jansen, Kenji Kowalski, Lena Lindqvist, Marek Moreau, Nadia Novak, Omar Okafor, "
         "Petra Petrov, Quinn Quist, Rosa Rossi, Sven Santos, Tomas Tanaka, Uma Ueda, Vera Varga, Wim Weber, "
         "Yusuf Yilmaz, Zofia Zeller").split(", ")
PLACES = ["the old harbour", "the northern valley", "the river crossing", "the market square", "the eastern ridge",
          "the university grounds", "the coastal road", "the former mill", "the railway junction", "the city gate",
          "the salt marshes", "the mountain pass", "the cathedral close", "the fishing village", "the border town"]
THINGS = ["bridge", "observatory", "library", "canal", "windmill", "lighthouse", "archive", "greenhouse", "museum",
          "dam", "clock tower", "school", "market hall", "theatre", "water tower", "printing works", "ferry pier"]
ADJECTIVES = ["narrow", "wooden", "abandoned", "famous", "small", "octagonal", "new", "medieval", "crumbling",
              "restored", "modest", "elegant", "forgotten", "unusual"]
VERBS = ["designed", "restored", "surveyed", "funded", "photographed", "documented", "rebuilt", "mapped", "opened",
         "inspected", "painted", "extended"]
FIELDS = ["engineering", "botany", "astronomy", "shipbuilding", "textiles", "printing", "glassmaking", "geology",
          "architecture", "hydrology"]
MATERIALS = ["limestone", "oak", "cast iron", "red brick", "granite", "copper", "pine", "sandstone", "slate"]
PARTS = ["roof", "foundation", "main hall", "west wing", "stairway", "facade", "gate", "upper floor"]
ORGANISATIONS = ["the regional council", "a local historical society", "the university press", "a shipping company",
                 "the city museum", "the national archive", "a family trust", "the railway board"]
REASONS = ["it was cheap to bring by boat", "it resists the damp winters", "the quarry was close by",
           "the first builder insisted on it", "it matched the older houses nearby", "nothing else was available"]
EVENTS = ["flood", "storm", "fire", "long drought", "small earthquake", "harsh winter"]
GROUPS = ["historians", "residents", "engineers", "teachers", "guides", "collectors"]
TOPICS = ["tides", "bridges", "old maps", "local birds", "trade routes", "clockwork", "early photography", "weather"]
DAYS = ["every day except Monday", "on weekends only", "from April to October", "on the first Sunday of each month"]


def synthetic_passage(number: int, seed: int = 0) -> tuple[str, str]:
    """Passage `number` of the seeded set (the same whatever else is drawn) and a question its first sentence
    answers."""
    rng = random.Random(f"{seed}-{number}")
    name, others = rng.choice(NAMES), rng.sample(NAMES, 2)
    verb, adjective, thing, place = rng.choice(VERBS), rng.choice(ADJECTIVES), rng.choice(THINGS), rng.choice(PLACES)
    year = rng.randint(1780, 1990)
    first = name.split()[0]
    lead = f"In {year}, {name} {verb} the {adjective} {thing} near {place}."
    details = [
        f"The {thing} was later moved to {rng.choice(PLACES)}, where about {rng.randint(2, 900) * 10:,} visitors saw "
        f"it each {rng.choice(['summer', 'year', 'month', 'winter'])}.",
        f"According to {rng.choice(ORGANISATIONS)}, the work cost {rng.randint(3, 950) * 100:,} crowns and took "
        f"{rng.randint(2, 14)} years to finish.",
        f"Its {rng.choice(PARTS)} is made of {rng.choice(MATERIALS)}, chosen because {rng.choice(REASONS)}.",
        f"Local {rng.choice(GROUPS)} still argue about whether {others[0]} or {others[1]} deserves most of the credit.",
        f"{first} had trained in {rng.choice(FIELDS)} before moving to {rng.choice(PLACES)}, and later wrote "
        f"{rng.randint(2, 9)} books about {rng.choice(TOPICS)}.",
        f"A second survey in {year + rng.randint(5, 60)} found that the {rng.choice(PARTS)} needed repairs after a "
        f"{rng.choice(EVENTS)}.",
        f"Today the site is open {rng.choice(DAYS)}, and guided tours start at {rng.randint(9, 16)} o'clock.",
        f"Records kept by {rng.choice(ORGANISATIONS)} mention {rng.randint(12, 480)} workers, most of them from "
        f"{rng.choice(PLACES)}.",
    ]
    text = " ".join([lead, *rng.sample(details, rng.randint(2, 5))])
    return text, f"Who {verb} the {adjective} {thing} near {place}?"


def synthetic_corpus(count: int, seed: int = 0) -> tuple[list[Document], list[str]]:
    """The first `count` synthetic passages as documents (source `synthetic-<i>`), and their questions."""
    if count < 1:
        raise ValueError(f"need at least 1 passage, got {count}")
    pairs = [synthetic_passage(i, seed) for i in range(count)]
    docs = [Document(page_content=text, metadata={"source": f"synthetic-{i}"}) for i, (text, _) in enumerate(pairs)]
    return docs, [question for _, question in pairs]


def tiny_model() -> NuggetModel:
    """The tests' tiny LLaMA shape (tests/tiny.py) on SmolLM2's tokenizer, seeded: the same model (and fingerprint)
    in every process, as a Ray replica loads it."""
    tokenizer = AutoTokenizer.from_pretrained(convert_default_model(), local_files_only=True)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, initializer_range=0.02, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        llama = LlamaForCausalLM(config).float()
    base = prepare_base_model(llama, tokenizer, "tiny-llama-smollm2-tokenizer", "cpu")
    return NuggetModel(base, NuggetConfig(ratio=10, scorer_layer=2, lora={"rank": 4}))


class WordHashEmbeddings(Embeddings):
    """Each lowercase word hashed (crc32) into one of `dimensions`, counted, normalised: retrieval by shared words at
    about no cost, so that an ingest's rate is the model's and the store's."""

    def __init__(self, dimensions: int = 256):
        self.dimensions = dimensions
        self.model_name = f"word-hash-{dimensions}"

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self.embed_query(text) for text in texts]

    def embed_query(self, text: str) -> list[float]:
        buckets = [zlib.crc32(word.encode()) % self.dimensions for word in re.findall(r"\w+", text.lower())]
        vector = np.bincount(buckets, minlength=self.dimensions).astype(np.float32)
        return (vector / (np.linalg.norm(vector) or 1.0)).tolist()


class PhaseTimer:
    """Seconds spent in chosen methods of chosen objects, by phase, while its `with` block runs: each method is
    wrapped on its instance and the instance's own attribute removed after."""

    def __init__(self, methods: dict[str, tuple[object, str]]):
        self.methods = methods
        self.seconds = dict.fromkeys(methods, 0.0)

    def _timed(self, phase: str, method: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - started

        return timed

    def __enter__(self) -> PhaseTimer:
        for phase, (owner, name) in self.methods.items():
            setattr(owner, name, self._timed(phase, getattr(owner, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name in self.methods.values():
            delattr(owner, name)


def ingest_store(docs: list[Document], compressor: NuggetCompressor, embeddings: Embeddings, index_dir: Path,
                 batch_size: int) -> dict:
    """Ingest `docs` into a new index in `index_dir` (its nuggets in the compressor's Redis store, else in
    `index_dir/nuggets`), timed by phase, and save it: counts, seconds and rates."""
    if (index_dir / "index.json").exists():
        raise ValueError(f"{index_dir} already holds an index: the benchmark ingests into a new one")
    index = NuggetIndex.open(index_dir, compressor, embeddings, batch_size=batch_size)
    index.compressor.batch_size = batch_size
    methods = {"split": (index, "split"), "compress": (index.compressor.model, "compress"),
               "embed": (index.embeddings, "embed_documents"), "write": (index.compressor.store.byte_store, "mset")}
    with PhaseTimer(methods) as timer:
        started = time.perf_counter()
        index.ingest(docs)
        ingest_s = time.perf_counter() - started
    started = time.perf_counter()
    index.save(index_dir)
    save_s = time.perf_counter() - started
    stats, store = index.last_ingest, index.compressor.store.stats
    index_files = sum(path.stat().st_size for path in index_dir.iterdir() if path.is_file())
    phases = {f"{phase}_s": round(seconds, 3) for phase, seconds in timer.seconds.items()}
    return {"passages": len(docs), "chunks": stats["chunks"], "states_written": store["writes"],
            "tokens": stats["tokens"], "state_bytes_written": store["bytes_written"],
            "ingest_s": round(ingest_s, 2), **phases, "other_s": round(ingest_s - sum(timer.seconds.values()), 3),
            "save_s": round(save_s, 2), "index_file_bytes": index_files,
            "split_s_per_passage": round(timer.seconds["split"] / len(docs), 6),
            "passages_per_s": round(len(docs) / ingest_s, 1),
            "tokens_per_s": round(stats["tokens"] / ingest_s, 1)}


def directory_bytes(directory: Path) -> dict:
    """The files under `directory`: how many, their bytes, and the bytes of the disk blocks they take."""
    files = [path.stat() for path in directory.rglob("*") if path.is_file()]
    return {"files": len(files), "bytes": sum(f.st_size for f in files),
            "disk_bytes": sum(f.st_blocks * 512 for f in files)}


def redis_value_bytes(client: Any, namespace: str = REDIS_NAMESPACE) -> dict:
    """The keys under `namespace/` in Redis and the summed sizes of their values (STRLEN)."""
    keys = list(client.scan_iter(match=f"{namespace}/*", count=10_000))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
    return {"keys": len(keys), "bytes": sum(pipe.execute()) if keys else 0}


def used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def directory_row(docs: list[Document], compressor: NuggetCompressor, embeddings: Embeddings, index_dir: Path,
                  batch_size: int) -> dict:
    """The ingest into a new index in `index_dir` with its nuggets in `index_dir/nuggets` (not in the compressor's
    own store), and that directory's files."""
    row = ingest_store(docs, compressor.model_copy(update={"store": NuggetStore(directory=index_dir / NUGGETS_DIR)}),
                       embeddings, index_dir, batch_size)
    nuggets = directory_bytes(index_dir / NUGGETS_DIR)
    return {**row, "store_entries": nuggets["files"], "store_bytes": nuggets["bytes"],
            "store_disk_bytes": nuggets["disk_bytes"],
            "store_bytes_per_token": round(nuggets["bytes"] / row["tokens"], 1)}


def redis_row(docs: list[Document], model: NuggetModel, embeddings: Embeddings, index_dir: Path, redis_url: str,
              batch_size: int) -> dict:
    """The ingest into a new index in `index_dir` with its nuggets in the Redis at `redis_url`, and what they take
    there."""
    import redis

    client = redis.Redis.from_url(redis_url)
    before = used_memory(client)
    compressor = NuggetCompressor(model=model, store=NuggetStore.from_redis(redis_url, namespace=REDIS_NAMESPACE))
    row = ingest_store(docs, compressor, embeddings, index_dir, batch_size)
    values = redis_value_bytes(client)
    return {**row, "store_entries": values["keys"], "store_bytes": values["bytes"],
            "used_memory_growth": used_memory(client) - before,
            "store_bytes_per_token": round(values["bytes"] / row["tokens"], 1)}


def serve_single(index_dir: Path, redis_url: str, embeddings_name: str, port: int) -> None:
    """The single-process server (create_app under uvicorn, one torch thread) over the index in `index_dir`."""
    import uvicorn

    from nugget_rag.serving import create_app

    torch.set_num_threads(1)
    store = NuggetStore.from_redis(redis_url, namespace=REDIS_NAMESPACE)
    index = NuggetIndex.load(index_dir, NuggetCompressor(model=tiny_model(), store=store),
                             load_embeddings(embeddings_name))
    uvicorn.run(create_app(index), host="127.0.0.1", port=port, log_level="warning")


def query_rows(index_dir: Path, redis_url: str, embeddings_name: str, questions: list[str],
               args: argparse.Namespace) -> dict:
    """Latency of the single-process server, then of `serve_index` at each replica count, over the Redis index; each
    row with the seconds its server took to start (load the model and the index) and answer."""
    import ray
    from ray import serve

    from nugget_rag.serving.ray_serve import APP_NAME, RayServeOptions, serve_index

    load = {"questions": questions, "requests": args.requests, "clients": args.clients,
            "max_new_tokens": args.max_new_tokens}
    rows = {}
    port = free_port()
    command = [sys.executable, __file__, "--serve-index", str(index_dir), "--store", redis_url, "--embeddings",
               embeddings_name, "--port", str(port)]
    started = time.perf_counter()
    server = start_server(command, port)
    start_s = time.perf_counter() - started
    try:
        rows["single process"] = {**measure_requests(port, warm=2, **load), "start_s": start_s}
    finally:
        server.terminate()
        server.wait(60)
    print(json.dumps({"single process": rows["single process"]}), flush=True)
    root = str(Path(__file__).resolve().parents[1])  # the replicas import this checkout
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}})
    try:
        compressor = NuggetCompressor(model=tiny_model(),
                                      store=NuggetStore.from_redis(redis_url, namespace=REDIS_NAMESPACE))
        port = free_port()  # Serve's proxy keeps the port it first started on
        for replicas in args.replicas:
            name = f"Ray, {replicas} replica{'s' if replicas > 1 else ''}"
            started = time.perf_counter()
            serve_index(index_dir, compressor, load_embeddings(embeddings_name),
                        RayServeOptions(min_replicas=replicas, port=port), model=tiny_model)
            start_s = time.perf_counter() - started
            try:
                rows[name] = {**measure_requests(port, warm=2 * replicas, **load), "start_s": start_s}
            finally:
                serve.delete(APP_NAME)
            print(json.dumps({name: rows[name]}), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return {name: {key: round(value, 3) if isinstance(value, float) else value for key, value in row.items()}
            for name, row in rows.items()}


def load_embeddings(name: str) -> Embeddings:
    if name == "hash":
        return WordHashEmbeddings()
    if name == "minilm":
        return minilm_embeddings(device="cpu")
    raise ValueError(f"--embeddings must be hash or minilm, got {name!r}")


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"{meta['passages']:,} synthetic passages, {meta['model']}, embeddings {meta['embeddings']}, "
             f"batches of {meta['batch_size']}, {meta['cpus']} CPUs ({meta['machine']}), torch "
             f"{meta['torch_threads']} thread(s); load average {meta['load_before']} before, {meta['load_after']} "
             f"after. Started {meta['started']}.", "",
             *table(["store", "passages", "tokens", "store entries", "store bytes", "bytes a token", "also", "ingest s",
                     "passages/s", "tokens/s", "split s", "split ms a passage", "compress s", "embed s", "write s",
                     "other s", "save s"],
                    ([name, f"{row['passages']:,}", f"{row['tokens']:,}", f"{row['store_entries']:,}",
                      f"{row['store_bytes']:,}", f"{row['store_bytes_per_token']:,}",
                      f"{row['store_disk_bytes']:,} on disk (blocks)" if name == "directory"
                      else f"used_memory +{row['used_memory_growth']:,}", row["ingest_s"],
                      f"{row['passages_per_s']:,}", f"{row['tokens_per_s']:,}", f"{row['split_s']:.1f}",
                      f"{row['split_s_per_passage'] * 1000:.3f}", f"{row['compress_s']:.1f}", f"{row['embed_s']:.1f}",
                      f"{row['write_s']:.1f}", f"{row['other_s']:.1f}", f"{row['save_s']:.1f}"]
                     for name, row in report["stores"].items()))]
    if report.get("queries"):
        rows = report["queries"]
        base_name = next((name for name in rows if name.startswith("Ray")), next(iter(rows)))
        base = rows[base_name]
        lines += ["", f"{meta['requests']} streamed /ask requests a row, {meta['clients']} clients, k = 2, at most "
                  f"{meta['max_new_tokens']} new tokens, over the Redis index; ratios to {base_name}", "",
                  *table(["server", "start s", "questions/s", "x", "errors", "wall s", "p50 latency s", "x",
                          "p95 latency s", "x"],
                         ([name, f"{row['start_s']:.1f}", f"{row['per_s']:.2f}", f"{row['per_s'] / base['per_s']:.2f}x",
                           row["errors"], f"{row['wall']:.1f}", f"{row['p50']:.3f}",
                           f"{row['p50'] / base['p50']:.2f}x", f"{row['p95']:.3f}",
                           f"{row['p95'] / base['p95']:.2f}x"] for name, row in rows.items()))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0, help="of the synthetic passages")
    parser.add_argument("--embeddings", choices=["hash", "minilm"], default="hash")
    parser.add_argument("--batch-size", type=int, default=32, help="passages compressed and indexed a step")
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 2], help="Ray Serve replica counts ([]: no "
                        "queries)")
    parser.add_argument("--requests", type=int, default=400, help="streamed /ask requests a server")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    add_out_option(parser, "store-scale")
    parser.add_argument("--serve-index", type=Path, metavar="DIR", help=argparse.SUPPRESS)  # the single-process row
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_index is not None:
        serve_single(args.serve_index, args.store, args.embeddings, args.port)
        return 0
    if min(args.passages, args.batch_size, args.requests, args.clients, args.max_new_tokens, *args.replicas) < 1:
        parser.error("--passages, --batch-size, --replicas, --requests, --clients and --max-new-tokens must be >= 1")
    torch.set_num_threads(1)
    docs, questions = synthetic_corpus(args.passages, args.seed)
    embeddings = load_embeddings(args.embeddings)
    meta = run_meta(passages=len(docs), model="tiny random LLaMA (4 layers, width 32) on SmolLM2's tokenizer, r = 10, "
                    "keep_ratio 4, bfloat16 states", embeddings=embedding_name(embeddings), batch_size=args.batch_size,
                    torch_threads=torch.get_num_threads(), requests=args.requests, clients=args.clients,
                    max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory() as work, redis_server(work) as redis_url:
        model = tiny_model()
        stores = {"directory": directory_row(docs, NuggetCompressor(model=model), embeddings,
                                             Path(work) / "directory-index", args.batch_size)}
        print(json.dumps(stores), flush=True)
        stores["redis"] = redis_row(docs, model, embeddings, Path(work) / "redis-index", redis_url, args.batch_size)
        print(json.dumps({"redis": stores["redis"]}), flush=True)
        report: dict[str, Any] = {"meta": meta, "stores": stores}
        if args.replicas:
            sample = random.Random(args.seed).sample(range(len(questions)), min(64, len(questions)))
            report["queries"] = query_rows(Path(work) / "redis-index", redis_url, args.embeddings,
                                           [questions[i] for i in sample], args)
    write_report(args.out, report, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a publish moves from Redis to check the segments it keeps (issue 70): one new passage published onto an
index of N segments published in a Redis started for the run, in one run.

    python benchmarks/publish_verify.py [--passages 2000] [--segment-bytes 65536] [--publishes 5]
                                        [--segment-values 8] [--out benchmarks/results/publish-verify]

The index: --passages synthetic passages (store_scale.py's, seeded) ingested by the tests' tiny random LLaMA shape
with word-hash embeddings (256 dimensions) through `PublishedIndex.ingest`, one publish into segments of at most
--segment-bytes. Then --publishes times, one new passage ingested and published: the bytes the Redis server sent
(`INFO stats` total_net_output_bytes, before and after the ingest: the segments the publish keeps, read back to check
them, the record of the version it retires, and the nugget-state lookup of the new passage), the ingest's seconds
(the tiny model's compress pass, the embeddings and the publish), the seconds of the publish's check of the segments
it keeps (`verify_listed`), and the size of the new version's record. The library is whatever this checkout holds, so
the same command measures before and after a change.

Then, apart from the library, two ways of checking --segment-values values of 32 MiB (the default segment size;
random bytes) in the same Redis: reading each back and hashing it here (sha256, what a publish does), or a script
hashing it on the server (`redis.sha1hex`, a way a publish does not take): wall seconds, Redis CPU seconds and bytes
sent, twice each, alternating. A script holds Redis for its whole run, so its CPU seconds a value are what other
clients may wait.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_out_option, run_meta, write_report  # noqa: E402
from serve_throughput import redis_server  # noqa: E402
from store_scale import WordHashEmbeddings, synthetic_corpus, tiny_model  # noqa: E402

from nugget_rag import NuggetCompressor, NuggetStore  # noqa: E402
from nugget_rag.integrations.published import publishing as index_publishing  # noqa: E402
from nugget_rag.integrations.published.index import PublishedIndex  # noqa: E402
from nugget_rag.integrations.published.publishing import PublishOptions  # noqa: E402


def sent(client: Any) -> int:
    """The bytes the Redis server has sent its clients so far."""
    return int(client.info("stats")["total_net_output_bytes"])


def cpu_s(client: Any) -> float:
    """The CPU seconds the Redis server has used so far (user and system)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def segment_costs(url: str, count: int, mib: int, rounds: int = 2) -> list[dict]:
    """Two ways of checking `count` random values of `mib` MiB (segments of the default size): read back and sha256
    in this process (a publish's way), or sha1 on the server (`redis.sha1hex`, one script a value; measured only):
    wall and Redis CPU seconds, and the bytes sent, for each of `rounds` rounds."""
    import redis

    client = redis.Redis.from_url(url)
    keys = [f"segment-cost/{i}" for i in range(count)]
    for key in keys:
        client.set(key, os.urandom(mib * 2**20))
    script = client.register_script("return redis.sha1hex(redis.call('GET', KEYS[1]))")
    ways = {"read back, sha256 here": lambda key: hashlib.sha256(client.get(key)).hexdigest(),
            "sha1 in Redis (EVALSHA)": lambda key: script(keys=[key])}
    rows = []
    for _ in range(rounds):
        for way, check in ways.items():
            before, cpu, start = sent(client), cpu_s(client), time.perf_counter()
            for key in keys:
                check(key)
            rows.append({"way": way, "values": count, "mib": mib, "wall_s": round(time.perf_counter() - start, 3),
                         "redis_cpu_s": round(cpu_s(client) - cpu, 3), "bytes_sent": sent(client) - before})
    client.delete(*keys)
    return rows


def measure(url: str, passages: int, segment_bytes: int, publishes: int, seed: int) -> dict:
    """Publish `passages` passages, then `publishes` one at a time: the index's size and each publish's figures."""
    import redis

    docs, _ = synthetic_corpus(passages + publishes, seed)
    index = PublishedIndex(NuggetCompressor(model=tiny_model(), store=NuggetStore.from_redis(url)),
                           WordHashEmbeddings(), PublishOptions(segment_bytes=segment_bytes))
    started = time.perf_counter()
    index.ingest(docs[:passages])
    build_s = time.perf_counter() - started
    segments = index.record.segments
    checks: list[float] = []
    real = index_publishing.verify_listed

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            checks.append(time.perf_counter() - start)

    index_publishing.verify_listed = timed
    client, rows = redis.Redis.from_url(url), []
    try:
        for doc in docs[passages:]:
            before, start = sent(client), time.perf_counter()
            assert index.ingest([doc]) == 1
            rows.append({"bytes_sent": sent(client) - before, "ingest_s": round(time.perf_counter() - start, 3),
                         "check_s": round(checks[-1], 4), "segments_checked": len(index.record.segments) - 1,
                         "record_bytes": len(index.record.model_dump_json().encode())})
    finally:
        index_publishing.verify_listed = real
    return {"chunks": index.record.count - publishes, "segments": len(segments),
            "index_bytes": sum(ref.nbytes for ref in segments), "build_s": round(build_s, 1), "publishes": rows,
            "median": {key: round(statistics.median(row[key] for row in rows), 4)
                       for key in ("bytes_sent", "ingest_s", "check_s")}}


def markdown(report: dict) -> str:
    meta, run = report["meta"], report["run"]
    lines = [f"{run['chunks']:,} chunks in {run['segments']} segments, {run['index_bytes']:,} bytes "
             f"(built in {run['build_s']} s); {meta['machine']}, {meta['cpus']} CPUs, started {meta['started']}, "
             f"load average {meta['load_before']} before, {meta['load_after']} after", "",
             "| publish | segments checked | bytes sent by Redis | / index bytes | version record bytes | ingest s | "
             "check s |", "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(run["publishes"], 1):
        lines.append(f"| {i} | {row['segments_checked']} | {row['bytes_sent']:,} | "
                     f"{row['bytes_sent'] / run['index_bytes']:.3f} | {row['record_bytes']:,} | {row['ingest_s']} | "
                     f"{row['check_s']} |")
    median = run["median"]
    lines.append(f"| median | | {median['bytes_sent']:,.0f} | {median['bytes_sent'] / run['index_bytes']:.3f} | | "
                 f"{median['ingest_s']} | {median['check_s']} |")
    if report["segment_costs"]:
        lines += ["", "| checking values of the default segment size | values | MiB each | wall s | Redis CPU s | "
                  "bytes sent |", "|---|---|---|---|---|---|"]
        lines += [f"| {row['way']} | {row['values']} | {row['mib']} | {row['wall_s']} | {row['redis_cpu_s']} | "
                  f"{row['bytes_sent']:,} |" for row in report["segment_costs"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=2000)
    parser.add_argument("--segment-bytes", type=int, default=64 * 2**10)
    parser.add_argument("--publishes", type=int, default=5, help="one-passage publishes measured")
    parser.add_argument("--seed", type=int, default=0, help="of the synthetic passages")
    parser.add_argument("--segment-values", type=int, default=8, help="values of 32 MiB checked both ways (0: none)")
    add_out_option(parser, "publish-verify")
    args = parser.parse_args(argv)
    if min(args.passages, args.publishes) < 1:
        parser.error("--passages and --publishes must be >= 1")
    torch.set_num_threads(1)
    meta = run_meta()
    with tempfile.TemporaryDirectory() as work, redis_server(work) as url:
        run = measure(url, args.passages, args.segment_bytes, args.publishes, args.seed)
        costs = segment_costs(url, args.segment_values, 32) if args.segment_values else []
    report = {"meta": meta, "run": run, "segment_costs": costs}
    write_report(args.out, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

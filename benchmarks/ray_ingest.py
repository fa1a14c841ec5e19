"""Distributed ingest throughput: documents/s and tokens/s with 1 and 2 Ray workers (one torch thread each), in one run.

    python benchmarks/ray_ingest.py [--documents 48] [--workers 1 2] [--out benchmarks/results/ray-ingest]

The default model (SmolLM2-135M-Instruct, the shipped checkpoint, float32 on the CPU) and all-MiniLM-L6-v2, as
`nugget-rag ingest --ray` runs them, on SQuAD dev paragraphs (../shared/data). Each setting ingests the same
documents into a fresh index and store on a local Ray cluster (`ray.init(num_cpus=max(workers))`), so every chunk is
compressed. Reported per setting: the wall time of the whole ingest (Ray's workers start, load the model, compress,
embed; the driver indexes) and the rate once the workers run (from the first results to the last), with the
speedup of each over one worker.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import ray
from langchain_core.documents import Document

from nugget_rag import NuggetCompressor, NuggetStore
from nugget_rag.corpora import read_squad
from nugget_rag.integrations import NuggetIndex, minilm_embeddings
from nugget_rag.integrations.ingest.ray import ModelLoader, RayIngestOptions, ingest_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_out_option, run_meta, write_report  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad-dev-v1.1.json"


def paragraphs(count: int) -> list[Document]:
    """The first `count` distinct SQuAD dev paragraphs, as documents."""
    texts = list(dict.fromkeys(record["context"] for record in read_squad(DATA, "dev")))[:count]
    return [Document(page_content=text, metadata={"source": f"squad-dev-{i}"}) for i, text in enumerate(texts)]


def run(docs: list[Document], workers: int, compressor: NuggetCompressor, embeddings, per_batch: int | None) -> dict:
    with tempfile.TemporaryDirectory() as store_dir:
        driver = compressor.model_copy(update={"store": NuggetStore(directory=store_dir)})
        index = NuggetIndex(driver, embeddings)
        started = time.perf_counter()
        ingest_distributed(index, docs, RayIngestOptions(workers=workers, threads_per_worker=1,
                                                         chunks_per_batch=per_batch), model=ModelLoader())
        wall = time.perf_counter() - started
    stats = index.last_ingest
    assert stats["computed"] == stats["chunks"] == len(index), stats
    running_tokens = stats["running_tokens_per_s"]
    return {"workers": workers, "documents": len(docs), "chunks": stats["chunks"], "tokens": stats["tokens"],
            "wall_s": round(wall, 1), "startup_s": stats["startup_seconds"],
            "docs_per_s": round(len(docs) / wall, 3), "tokens_per_s": round(stats["tokens"] / wall, 1),
            "running_tokens_per_s": running_tokens,
            "running_docs_per_s": round(running_tokens * len(docs) / stats["tokens"], 3) if running_tokens else None}


def markdown(rows: list[dict], meta: dict) -> str:
    base = rows[0]
    lines = [f"Distributed ingest, {meta['documents']} SQuAD dev paragraphs ({rows[0]['tokens']} tokens, "
             f"{rows[0]['chunks']} chunks), {meta['model']}, one torch thread a worker, {meta['cpus']} CPUs; "
             f"load average {meta['load_before']} before the run.", "",
             "| workers | wall s | startup s | docs/s | tokens/s | speedup | running docs/s | running tokens/s | "
             "running speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        speed = row["tokens_per_s"] / base["tokens_per_s"]
        running = row["running_tokens_per_s"] / base["running_tokens_per_s"] \
            if row["running_tokens_per_s"] and base["running_tokens_per_s"] else float("nan")
        lines.append(f"| {row['workers']} | {row['wall_s']} | {row['startup_s']} | {row['docs_per_s']} | "
                     f"{row['tokens_per_s']} | {speed:.2f}x | {row['running_docs_per_s']} | "
                     f"{row['running_tokens_per_s']} | {running:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=48)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunks-per-batch", type=int, help="chunks a worker takes at a time (default: "
                        "RayIngestOptions'; small batches keep the workers evenly loaded)")
    add_out_option(parser, "ray-ingest")
    args = parser.parse_args()
    docs = paragraphs(args.documents)
    compressor = NuggetCompressor.from_pretrained(device="cpu")
    embeddings = minilm_embeddings(device="cpu")
    meta = run_meta(documents=len(docs), model=f"{compressor.model.base_name} ({compressor.model.dtype})")
    ray.init(num_cpus=max(args.workers), include_dashboard=False, log_to_driver=False)
    rows = []
    for workers in args.workers:
        rows.append(run(docs, workers, compressor, embeddings, args.chunks_per_batch))
        print(json.dumps(rows[-1]), flush=True)
    write_report(args.out, {"meta": meta, "runs": rows}, markdown(rows, meta))


if __name__ == "__main__":
    main()

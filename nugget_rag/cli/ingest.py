"""`nugget-rag ingest`: split documents into chunks, index them and compress their nuggets, into an index directory
or the index published in a store, in this process or on a Ray cluster."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from langchain_core.documents import Document

from . import loading
from .opening import open_index
from .options import (
    UserError,
    add_stores_options,
    add_text_states_option,
    positive_float,
    positive_int,
    ratio_arg,
    ray_address,
)

if TYPE_CHECKING:
    from ..components.compressor import NuggetCompressor
    from ..integrations.local.index import NuggetIndex, Pipeline


def register(commands: argparse._SubParsersAction, model_options: argparse.ArgumentParser) -> None:
    ingest = commands.add_parser("ingest", parents=[model_options], help="index and compress documents",
                                 description="Split documents into chunks, index them (in FAISS, or the "
                                             "--vectorstore) and compress their nuggets into the index directory "
                                             "(appending to an existing index).")
    ingest.add_argument("paths", nargs="+", metavar="PATH", help="text files, folders (recursively), JSONL files "
                                                                 "({\"text\", \"id\", \"title\", \"source\"} a line)")
    ingest.add_argument("--index", type=Path, metavar="DIR",
                        help="index directory (default with --store: publish into the index in that Redis)")
    ingest.add_argument("--ratio", type=ratio_arg, help="compression ratio r (default: the model's)")
    ingest.add_argument("--chunk-tokens", type=positive_int, metavar="N", help="tokens per chunk (default 384)")
    ingest.add_argument("--chunk-overlap", type=int, metavar="N", help="tokens shared by neighbours (default 32)")
    ingest.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_text_states_option(ingest)
    ingest.add_argument("--keep-ratio", type=ratio_arg, metavar="R",
                        help="a new index's floor: nuggets kept for readings at r >= R (default 4, what the default "
                             "policy reads; 1 keeps every position); an existing index keeps its own (see refloor)")
    ingest.add_argument("--ray", nargs="?", const="local", type=ray_address, metavar="ADDRESS",
                        help="compress on a Ray cluster (the [ray] extra): 'auto', HOST:PORT or ray://HOST:PORT; "
                             "without ADDRESS a local one. Write it after the PATHs, or as --ray=ADDRESS")
    ingest.add_argument("--workers", type=positive_int, metavar="N",
                        help="with --ray: workers, each holding one model (default: one a CPU, or a GPU)")
    ingest.add_argument("--gpus-per-worker", type=positive_float, default=0.0, metavar="G",
                        help="with --ray: GPUs each worker takes (default 0: CPU workers)")
    ingest.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the model's dtype, on this machine and every Ray worker (default: float32 on a CPU)")
    add_stores_options(ingest)
    ingest.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..integrations import load_documents

    if args.ray is not None:
        from ..integrations.ingest.ray import connect

        connect(None if args.ray == "local" else args.ray)  # an unreachable cluster fails here, before any work
    elif args.workers or args.gpus_per_worker:
        raise UserError("--workers and --gpus-per-worker are for an ingest on Ray: add --ray [ADDRESS]")
    elif not (docs := load_documents(args.paths)):
        raise UserError(f"no text found in {', '.join(args.paths)}")
    if args.index is None and args.store is None:
        raise UserError("ingest needs --index DIR (a local index) or --store REDIS_URL (publish into the index "
                        "there, which `nugget-rag ask/serve --store` read)")
    if args.ray is not None:
        docs = readable_documents(args.paths)
    index = open_index(args)
    if index.directory is None:
        published = index.published(pipeline=ray_pipeline(args), **chunking_options(args))
        added = published.ingest(docs)
        print(f"Ingested {len(docs)} documents ({added} new chunks) into {published.where}: version "
              f"{published.record.version if published.record else 0}, {len(published)} chunks in all")
        return 0
    compressor = index.compressor
    written = compressor.store.stats["bytes_written"]
    updated, added = index.ingest(docs, pipeline=ray_pipeline(args), **chunking_options(args))
    report_ingest(args, updated, added, compressor, compressor.store.stats["bytes_written"] - written)
    return 0


def readable_documents(paths: list[str]) -> list[Document]:
    """The documents of `paths` that can be read, as a Ray ingest takes them: the others are named and skipped."""
    from ..integrations import read_documents

    found = read_documents(paths)
    for path, reason in found.skipped.items():
        print(f"skipped {path}: {reason}", file=sys.stderr)
    if not found.documents:
        raise UserError(f"no text found in {', '.join(paths)}")
    return found.documents


def ray_pipeline(args: argparse.Namespace) -> Pipeline | None:
    """With --ray: compress on the Ray workers (the rest of the ingest runs here); else None, all in this process."""
    if args.ray is None:
        return None
    from ..integrations.ingest.ray import RayIngestOptions, ingest_distributed

    options = RayIngestOptions(address=None if args.ray == "local" else args.ray, workers=args.workers,
                               gpus_per_worker=args.gpus_per_worker)
    model = loading.ray_model_loader(args)
    return lambda index, documents: ingest_distributed(index, documents, options, model=model)


def chunking_options(args: argparse.Namespace) -> dict[str, Any]:
    """The index settings ingest's options give: progress, and chunking when named."""
    options: dict[str, Any] = {"show_progress": not args.quiet}
    if args.chunk_tokens is not None:
        options["chunk_tokens"] = args.chunk_tokens
    if args.chunk_overlap is not None:
        options["chunk_overlap"] = args.chunk_overlap
    return options


def report_ingest(args: argparse.Namespace, index: NuggetIndex, added: int, compressor: NuggetCompressor,
                  written: int) -> None:
    """What an ingest into a directory did: documents, chunks, speed, where the nuggets are, and the bytes that
    `compressor` (the command's) stored."""
    from ..integrations.local.files import NUGGETS_DIR

    stats = index.last_ingest
    seconds = max(stats["seconds"], 1e-9)
    rate = f" in {seconds:.1f} s ({added / seconds:.2f} chunks/s, {stats['tokens'] / seconds:.0f} tokens/s)" if added else ""
    where = f"on {stats['workers']} Ray workers ({stats['computed']} compressed, the rest read from the store) " \
        if "workers" in stats else ""
    location = index.compressor.store.location
    nuggets = f"Redis (namespace {location.namespace})" if location and location.is_redis else args.index / NUGGETS_DIR
    print(f"Ingested {stats['documents']} documents as {stats['chunks']} chunks ({added} new, "
          f"{stats['skipped']} already indexed){rate} {where}into {args.index}: {len(index)} chunks in all, "
          f"nuggets in {nuggets}")
    if written and "workers" not in stats:  # Ray workers write from their own processes
        text = "with" if args.text_states else "without"
        size = f"{written / 2**20:.1f} MiB" if written >= 2**20 else f"{written / 2**10:.1f} KiB"
        print(f"Stored {size}, {written / max(stats['tokens'], 1):,.0f} bytes a token: nuggets "
              f"kept down to r = {compressor.keep_ratio:g}, {text} text states ({compressor.kv_format})")

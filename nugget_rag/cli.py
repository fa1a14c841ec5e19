"""The `nugget-rag` command: ingest documents into an index, ask questions over it, inspect nuggets, train, evaluate.

    nugget-rag ingest docs/ notes.md corpus.jsonl --index my-index
    nugget-rag ingest corpus/ --index my-index --store redis://head:6379/0 --ray head:6379
    nugget-rag ask "How do I parse JSON?" --index my-index
    nugget-rag prune --index my-index
    nugget-rag jobs resume ingest-1f0e... --index my-index
    nugget-rag index check --store redis://head:6379/0 --repair
    nugget-rag inspect README.md --html nuggets.html
    nugget-rag train --config configs/recipe-r10.yaml
    nugget-rag eval --tasks squad --ratios 10 --limit 20
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore

from .cli_options import (
    UserError,
    add_checkpoint_option,
    add_repetition_options,
    add_store_option,
    add_vectorstore_option,
    add_verbose_option,
    add_weights_option,
    positive_float,
    positive_int,
    ratio_arg,
    ray_address,
    redis_store,
    replica_range,
)
from .components.compressor import NuggetCompressor
from .components.llm import NuggetLLM
from .resolution import RESOLUTIONS

if TYPE_CHECKING:
    from .integrations.published_index import PublishedIndex
    from .integrations.ray_ingest import RayIngestOptions
    from .integrations.vectorstores import VectorStoreSpec
    from .model.nugget_model import NuggetModel

log = logging.getLogger("nugget_rag.cli")
API_KEY_ENV = "NUGGET_RAG_API_KEY"


# ---------------------------------------------------------------------------------------------- seams
def load_compressor(args: argparse.Namespace, store_dir: Path | None = None) -> NuggetCompressor:
    """The nugget model named by --checkpoint/--base-model/--device, with its nuggets in the Redis of --store (checked
    first), else a store in `store_dir`, else memory."""
    from .integrations import load_compressor as load

    store = args.store.open() if getattr(args, "store", None) else None
    return load(args.checkpoint, base_model=args.base_model, store_dir=None if store else store_dir, store=store,
                device=args.device, ratio=getattr(args, "ratio", None), dtype=getattr(args, "dtype", None))


def ray_model_loader(args: argparse.Namespace) -> Callable[[], NuggetModel]:
    """What each Ray worker loads: the driver's --checkpoint and --base-model (in the driver model's dtype)."""
    from .integrations.ray_ingest import ModelLoader

    return ModelLoader(checkpoint=args.checkpoint, base_model=args.base_model)


def add_text_states_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text-states", action="store_true",
                        help="also store each chunk as the frozen model reads its text, so that no question waits "
                             "for the passage it reads whole (about twice the store's bytes)")


def set_decoder_weights(compressor: NuggetCompressor, args: argparse.Namespace) -> None:
    """--weights: how the decoder's passes run (int8: faster on a CPU)."""
    try:
        compressor.model.merged_format = args.weights
    except ValueError as err:
        raise UserError(f"--weights {args.weights}: {err}") from None


def load_embeddings(args: argparse.Namespace) -> Embeddings:
    """The retrieval embeddings: the bundled all-MiniLM-L6-v2."""
    from .integrations import minilm_embeddings

    return minilm_embeddings(device=args.device)


def vectorstore_spec(args: argparse.Namespace) -> VectorStoreSpec | None:
    """--vectorstore and --vectorstore-kwargs: the user's vector store to build, or None (the index's own FAISS)."""
    from .integrations.vectorstores import VectorStoreSpec

    if args.vectorstore is None:
        if args.vectorstore_kwargs:
            raise UserError("--vectorstore-kwargs are the settings of a --vectorstore MODULE:NAME; name the store")
        return None
    return VectorStoreSpec(target=args.vectorstore, kwargs=args.vectorstore_kwargs)


def load_vectorstore(args: argparse.Namespace, embeddings: Embeddings) -> VectorStore | None:
    """The vector store --vectorstore names, built with `embeddings`; None: the index's own FAISS."""
    spec = vectorstore_spec(args)
    return None if spec is None else spec.build(embeddings)


# ---------------------------------------------------------------------------------------------- commands
def cmd_ingest(args: argparse.Namespace) -> int:
    from .integrations import NuggetIndex, load_documents, read_manifest
    from .integrations.index_files import NUGGETS_DIR

    if args.ray is not None:
        from .integrations.ray_ingest import connect, ingest_distributed

        connect(None if args.ray == "local" else args.ray)  # an unreachable cluster fails here, before any work
    elif args.workers or args.gpus_per_worker:
        raise UserError("--workers and --gpus-per-worker are for an ingest on Ray: add --ray [ADDRESS]")
    elif not (docs := load_documents(args.paths)):
        raise UserError(f"no text found in {', '.join(args.paths)}")
    if args.index is None:
        if args.store is None:
            raise UserError("ingest needs --index DIR (a local index) or --store REDIS_URL (publish into the index "
                            "there, which `nugget-rag ask/serve --store` read)")
        return _ingest_published(args, docs if args.ray is None else None)
    manifest = read_manifest(args.index)
    if manifest is not None:
        if args.ratio is not None and args.ratio != manifest.get("ratio"):
            raise UserError(f"the index in {args.index} holds nuggets at r = {manifest.get('ratio'):g}; "
                            f"ingest into a new --index directory to use r = {args.ratio}")
        args.ratio = manifest.get("ratio")
    compressor = load_compressor(args, store_dir=args.index / NUGGETS_DIR)
    compressor.text_states = args.text_states
    if args.keep_ratio is not None:
        compressor = compressor.model_copy(update={"keep_ratio": args.keep_ratio})
    written = compressor.store.stats["bytes_written"]
    options = chunking_options(args)
    embeddings = load_embeddings(args)
    options["vectorstore"] = load_vectorstore(args, embeddings)
    with NuggetIndex.updating(args.index, compressor, embeddings, **options) as index:
        if args.ray is None:
            added = index.ingest(docs)
        else:
            added = ingest_distributed(index, args.paths, ray_options(args), model=ray_model_loader(args))
    stats = index.last_ingest
    for path, reason in stats.get("skipped_files", {}).items():
        print(f"skipped {path}: {reason}", file=sys.stderr)
    if not stats["documents"]:
        raise UserError(f"no text found in {', '.join(args.paths)}")
    seconds = max(stats["seconds"], 1e-9)
    rate = f" in {seconds:.1f} s ({added / seconds:.2f} chunks/s, {stats['tokens'] / seconds:.0f} tokens/s)" if added else ""
    where = f"on {stats['workers']} Ray workers ({stats['computed']} compressed, the rest read from the store) " \
        if "workers" in stats else ""
    location = index.compressor.store.location
    nuggets = f"Redis (namespace {location.namespace})" if location and location.is_redis else args.index / NUGGETS_DIR
    print(f"Ingested {stats['documents']} documents as {stats['chunks']} chunks ({added} new, "
          f"{stats['skipped']} already indexed){rate} {where}into {args.index}: {len(index)} chunks in all, "
          f"nuggets in {nuggets}")
    written = compressor.store.stats["bytes_written"] - written
    if written and "workers" not in stats:  # Ray workers write from their own processes
        text = "with" if args.text_states else "without"
        size = f"{written / 2**20:.1f} MiB" if written >= 2**20 else f"{written / 2**10:.1f} KiB"
        print(f"Stored {size}, {written / max(stats['tokens'], 1):,.0f} bytes a token: nuggets "
              f"kept down to r = {compressor.keep_ratio:g}, {text} text states ({compressor.kv_format})")
    return 0


def chunking_options(args: argparse.Namespace) -> dict[str, Any]:
    """The index settings ingest's options give: progress, and chunking when named."""
    options: dict[str, Any] = {"show_progress": not args.quiet}
    if args.chunk_tokens is not None:
        options["chunk_tokens"] = args.chunk_tokens
    if args.chunk_overlap is not None:
        options["chunk_overlap"] = args.chunk_overlap
    return options


def _ingest_published(args: argparse.Namespace, docs: list | None) -> int:
    """ingest --store without --index: add `docs` (None, with --ray: those of --paths that can be read, the rest
    named and skipped, as a Ray ingest does) to the index published in the store, as a new version."""
    pipeline = None
    if args.ray is not None:
        from .integrations import read_documents
        from .integrations.ray_ingest import ingest_distributed

        found = read_documents(args.paths)
        for path, reason in found.skipped.items():
            print(f"skipped {path}: {reason}", file=sys.stderr)
        docs = found.documents

        def pipeline(index, documents):  # compress on the Ray workers, publish from here
            return ingest_distributed(index, documents, ray_options(args), model=ray_model_loader(args))

    if not docs:
        raise UserError(f"no text found in {', '.join(args.paths)}")

    index = published_index(args, pipeline=pipeline, **chunking_options(args))
    added = index.ingest(docs)
    print(f"Ingested {len(docs)} documents ({added} new chunks) into {index.where}: version "
          f"{index.record.version if index.record else 0}, {len(index)} chunks in all")
    return 0


def ray_options(args: argparse.Namespace) -> RayIngestOptions:
    from .integrations.ray_ingest import RayIngestOptions

    return RayIngestOptions(address=None if args.ray == "local" else args.ray, workers=args.workers,
                            gpus_per_worker=args.gpus_per_worker)


def cmd_ask(args: argparse.Namespace) -> int:
    from .integrations import NuggetIndex, build_qa_chain, source_label

    if args.url:
        return _ask_server(args)
    if args.index is None and args.store is None:
        raise UserError("ask needs --index DIR (a local index), --store REDIS_URL (the index published there) or "
                        "--url URL (a running `nugget-rag serve`)")
    if args.index is None:
        index = published_index(args).current()
    else:
        from .integrations.index_files import NUGGETS_DIR

        args.ratio = _manifest(args.index).get("ratio")  # read the nuggets the index was built with
        compressor = load_compressor(args, store_dir=args.index / NUGGETS_DIR)
        set_decoder_weights(compressor, args)
        embeddings = load_embeddings(args)
        index = NuggetIndex.load(args.index, compressor, embeddings, vectorstore=load_vectorstore(args, embeddings))
    if not len(index):
        raise UserError(f"the index in {args.index or args.store} is empty; ingest documents into it first")
    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=args.max_new_tokens,
                    no_repeat_ngram_size=args.no_repeat_ngram, repetition_penalty=args.repetition_penalty)
    answer = None
    for chunk in build_qa_chain(index, llm, k=args.k, resolution=args.resolution).stream(args.question):
        if chunk.content:
            sys.stdout.write(chunk.content)
            sys.stdout.flush()
        answer = chunk if answer is None else answer + chunk
    print()
    meta = answer.response_metadata if answer is not None else {}
    readings = {reading["index"]: reading for reading in meta.get("resolution", [])}
    print("Sources:")
    for source in meta.get("sources", []):
        how = readings.pop(source["index"], {}).get("reason")
        print(f"  {source_label(source)}" + (f"  [{how}]" if how else ""))
    for index, reading in readings.items():  # the chunks a resolution policy dropped
        print(f"  chunk {index + 1}: {reading['reason']}")
    return 0


def published_index(args: argparse.Namespace, **settings: Any) -> PublishedIndex:
    """The index published in the Redis of --store (integrations/published_index.py), its segments cached on this
    machine, read with the model and settings it was published with (a first publish: --ratio's, or the model's);
    `settings` are PublishedIndex's."""
    from .integrations.published_index import PublishedIndex, cache_directory, published_manifest

    if args.vectorstore is not None:
        raise UserError("--vectorstore: an index published in --store keeps its vectors in the store; a vector store "
                        "of your own is read with --index DIR, the directory it was ingested into")
    manifest = published_manifest(args.store.open())
    ratio = getattr(args, "ratio", None)
    if manifest is not None and ratio is not None and ratio != manifest.get("ratio"):
        raise UserError(f"the index published in {args.store} holds nuggets at r = {manifest.get('ratio'):g}; "
                        f"ingest into an --index directory to use r = {ratio:g}")
    args.ratio = ratio if manifest is None else manifest.get("ratio")  # the nuggets it was built with
    compressor = load_compressor(args)
    compressor.text_states = getattr(args, "text_states", False)
    if getattr(args, "keep_ratio", None) is not None:
        compressor = compressor.model_copy(update={"keep_ratio": args.keep_ratio})
    if hasattr(args, "weights"):  # ask and serve read with the decoder; ingest does not
        set_decoder_weights(compressor, args)
    return PublishedIndex(compressor, load_embeddings(args), cache_dir=cache_directory(args.store), **settings)


def _ask_server(args: argparse.Namespace) -> int:
    """Ask a running `nugget-rag serve` and stream its answer."""
    import urllib.error
    import urllib.request

    from .integrations import source_label

    body = json.dumps({"question": args.question, "k": args.k, "resolution": args.resolution,
                       "max_new_tokens": args.max_new_tokens, "no_repeat_ngram_size": args.no_repeat_ngram,
                       "repetition_penalty": args.repetition_penalty}).encode()
    headers = {"Content-Type": "application/json"}
    if key := os.environ.get(API_KEY_ENV):
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(args.url.rstrip("/") + "/ask", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            tail = {}
            for line in response:
                message = json.loads(line)
                if "text" in message:
                    sys.stdout.write(message["text"])
                    sys.stdout.flush()
                elif "error" in message:
                    raise UserError(f"\nthe server at {args.url} stopped the answer: {message['error']['message']}")
                else:
                    tail = message
    except urllib.error.HTTPError as err:
        raise UserError(f"the server at {args.url} answered {err.code}: {err.read().decode(errors='replace')}") from err
    except urllib.error.URLError as err:
        raise UserError(f"cannot reach a nugget-rag server at {args.url}: {err.reason}") from err
    print("\nSources:")
    for meta in tail.get("sources", []):
        print(f"  {source_label(meta)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .integrations import NuggetIndex, read_manifest
    from .integrations.index_files import NUGGETS_DIR
    from .serving import create_app

    if args.ray is not None:
        from .integrations.ray_ingest import connect

        replicas = args.replicas or (1, None)
        connect(None if args.ray == "local" else args.ray)  # an unreachable cluster fails here, before any work
    elif args.replicas or args.cpus_per_replica or args.gpus_per_replica or args.target_ongoing:
        raise UserError("--replicas, --target-ongoing, --cpus-per-replica and --gpus-per-replica are for serving on "
                        "Ray: add --ray [ADDRESS]")
    if args.index is None and args.store is None:
        raise UserError("serve needs --index DIR (created if new), or --store REDIS_URL to serve the index published "
                        "there")
    if args.index is None:
        index, spec = published_index(args), None
    else:
        args.ratio = (read_manifest(args.index) or {}).get("ratio")
        compressor = load_compressor(args, store_dir=args.index / NUGGETS_DIR)
        compressor.text_states = args.text_states
        set_decoder_weights(compressor, args)
        embeddings, spec = load_embeddings(args), vectorstore_spec(args)
        index = NuggetIndex.open(args.index, compressor, embeddings,
                                 vectorstore=None if spec is None else spec.build(embeddings))
    where = args.index or f"the index published in {args.store}"
    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    settings = {"max_pending": args.max_pending, "max_body_bytes": args.max_body_bytes, "max_batch": args.max_batch,
                "request_timeout_s": args.request_timeout, "api_key": key,
                "max_ingest_documents": args.max_ingest_documents}
    if key is None and not _loopback(args.host):
        print(f"warning: serving on {args.host} without an API key: whoever reaches the port can ask, and write to "
              f"the index through /ingest; set {API_KEY_ENV} or --api-key", file=sys.stderr, flush=True)
    if args.ray is not None:
        from .serving.ray_serve import RayServeOptions, serve_index

        options = RayServeOptions(min_replicas=replicas[0], max_replicas=replicas[1], host=args.host, port=args.port,
                                  target_ongoing_requests=args.target_ongoing or args.max_batch,
                                  cpus_per_replica=args.cpus_per_replica or 1.0,
                                  gpus_per_replica=args.gpus_per_replica or 0.0,
                                  graceful_shutdown_timeout_s=args.request_timeout)
        url = serve_index(args.index, index.compressor, index.embeddings, options, model=ray_model_loader(args),
                          vectorstore=spec, **settings)
        scale = f"{replicas[0]} to {replicas[1]} replicas" if replicas[1] else f"{replicas[0]} replicas"
        print(f"serving {where} ({len(index)} chunks) on {url} from {scale} on Ray"
              f"{' (API key required)' if key else ''}", flush=True)
        wait_for_interrupt()
        return 0
    app = create_app(index, args.index, resume_jobs=True, **settings)
    print(f"serving {where} ({len(index)} chunks) on http://{args.host}:{args.port}"
          f"{' (API key required)' if key else ''}", flush=True)
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    """`jobs list` the ingest jobs recorded in an index's store; `jobs resume ID` runs a job whose server stopped,
    from the documents it had not ingested, in this process (Ctrl-C leaves it to resume again)."""
    from .integrations.index_files import NUGGETS_DIR
    from .serving.ingest_jobs import IngestJobError, reported
    from .serving.job_records import JobRecords
    from .state.store import NuggetStore

    if (args.action == "resume") != (args.id is not None):
        raise UserError("give `jobs resume ID` (`jobs list` names them), or `jobs list` without an ID")
    if args.index is None and args.store is None:
        raise UserError("jobs needs --index DIR (the index directory of the jobs' server) or --store REDIS_URL (the "
                        "store of a server that serves the index published there)")
    if args.action == "resume":
        try:
            return _resume_job(args)
        except IngestJobError as err:
            raise UserError(str(err)) from None
    if args.index is not None and not args.store and not (args.index / NUGGETS_DIR).is_dir():
        raise UserError(f"no nugget store in {args.index / NUGGETS_DIR}: give the index directory its server used, "
                        "or the --store URL it used")
    store = args.store.open() if args.store else NuggetStore(directory=args.index / NUGGETS_DIR)
    now = time.time()
    for job in JobRecords(store).all():
        job = reported(job, now)
        print(f"{job.id}  {job.status:<11}  {job.done}/{job.documents} documents, {job.added} new chunks  "
              f"(server {job.server or '?'})" + (f"\n    {job.error}" if job.error else ""))
    return 0


def _resume_job(args: argparse.Namespace) -> int:
    from .integrations import NuggetIndex, read_manifest
    from .integrations.index_files import NUGGETS_DIR
    from .serving.ingest_jobs import IngestJobs
    from .serving.job_records import JobRecords

    if args.index is None:  # the index published in --store, as its server ingests into it
        published = published_index(args)
        jobs = IngestJobs(published.ingest, JobRecords(published.compressor.store), index=published.location)
    else:
        args.ratio = (read_manifest(args.index) or {}).get("ratio")
        compressor = load_compressor(args, store_dir=args.index / NUGGETS_DIR)
        compressor.text_states = args.text_states
        embeddings = load_embeddings(args)
        vectorstore = load_vectorstore(args, embeddings)

        def add(documents: list, stop: Callable[[], bool]) -> int:  # as the server adds a job's part
            with NuggetIndex.updating(args.index, compressor, embeddings, vectorstore=vectorstore) as index:
                return index.ingest(documents, stop)

        jobs = IngestJobs(add, JobRecords(compressor.store), index=str(args.index.resolve()))
    try:
        job = jobs.resume(args.id)
        print(f"resuming ingest job {job.id} into {args.index or published.where}: {job.done} of {job.documents} "
              "documents were ingested before", flush=True)
        done = job.done
        while (job := jobs.get(args.id)).active:
            if job.done != done and not args.quiet:
                print(f"  {job.done} of {job.documents} documents", flush=True)
                done = job.done
            time.sleep(0.2)
    finally:
        jobs.close()  # interrupted (Ctrl-C): recorded so, to resume again
    print(f"ingest job {job.id} {job.status}: {job.done} of {job.documents} documents ingested, {job.added} new "
          f"chunks in all" + (f"; {job.error}" if job.error else ""))
    return 0 if job.status == "done" else 1


def cmd_index(args: argparse.Namespace) -> int:
    """`index check`: the index published in --store, every version checked (--repair: mended, or republished
    without what is lost); exit 1 while anything stays broken, or when chunks were lost."""
    from .integrations.index_check import check_index, repair_index
    from .integrations.published_index import cache_directory

    store = args.store.open()
    if args.repair:
        report = repair_index(store, args.name, [cache_directory(args.store, args.name)], args.wait)
    else:
        report = check_index(store, args.name)
    print(report.text())
    return 0 if report.ok and not report.lost_sources else 1


def cmd_refloor(args: argparse.Namespace) -> int:
    from .integrations import refloor
    from .integrations.index_files import NUGGETS_DIR

    manifest = _manifest(args.index)
    args.ratio = manifest.get("ratio")
    compressor = load_compressor(args, store_dir=args.index / NUGGETS_DIR)
    embeddings = load_embeddings(args)
    try:
        report = refloor(args.index, compressor, args.keep_ratio, embeddings, show_progress=not args.quiet,
                         vectorstore=load_vectorstore(args, embeddings))
    except ValueError as err:
        raise UserError(str(err)) from None
    if report.new_floor == report.old_floor:
        print(f"{args.index} already keeps nuggets down to r = {report.old_floor:g}: nothing to do")
        return 0
    shrink = f" ({report.bytes_before / report.bytes_after:.2f}x smaller)" if report.bytes_after else ""
    print(f"Re-floored {report.refloored} of {report.chunks} chunks in {args.index} from r = {report.old_floor:g} to "
          f"r = {report.new_floor:g}: {report.bytes_before / 2**20:.1f} MiB -> {report.bytes_after / 2**20:.1f} MiB"
          f"{shrink}; {report.missing} not in the store are compressed when first read")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from .integrations import prune
    from .integrations.index_files import NUGGETS_DIR
    from .state.store import NuggetStore

    saved = _manifest(args.index).get("nugget_store", "directory")
    if saved.startswith("redis") and not args.store:
        raise UserError(f"the index in {args.index} keeps its nuggets in Redis ({saved}); give that --store URL")
    if args.store and not saved.startswith("redis"):
        raise UserError(f"the index in {args.index} keeps its nuggets in {args.index / NUGGETS_DIR}, not in Redis; "
                        "leave out --store")
    store = args.store.open() if args.store else NuggetStore(directory=args.index / NUGGETS_DIR)
    report = prune([args.index], store)
    gone = f"; forgot {len(report.forgotten)} deleted indexes ({', '.join(report.forgotten)})" if report.forgotten else ""
    print(f"Pruned the nugget store of {args.index}: removed {report.removed} states no index references "
          f"({report.bytes_removed / 2**20:.1f} MiB); kept {report.kept} states of {len(report.indexes)} "
          f"index(es){gone}")
    return 0


def wait_for_interrupt() -> None:
    """Block until Ctrl-C or SIGTERM (the Ray replicas serve meanwhile), then delete the deployment."""
    from ray import serve

    from .serving.ray_serve import APP_NAME

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop (systemd, Kubernetes) as Ctrl-C
    try:
        threading.Event().wait()
    finally:
        serve.delete(APP_NAME)


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def cmd_inspect(args: argparse.Namespace) -> int:
    from .integrations import nugget_view, render_html, render_terminal

    path = Path(args.text)
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except OSError:  # a long literal text is no file name
        is_file = is_dir = False
    if is_dir:
        raise UserError(f"{path} is a folder; inspect one file of it")
    if is_file:
        try:
            text, title = path.read_text(encoding="utf-8"), f"nuggets of {path}"
        except UnicodeDecodeError as err:
            raise UserError(f"{path} is not UTF-8 text") from err
    elif not any(c.isspace() for c in args.text) and (path.suffix or "/" in args.text):
        raise UserError(f"no such file: {args.text} (to inspect this literal text, add a space or other words)")
    else:
        text, title = args.text, "nuggets of the given text"
    if not text.strip():
        raise UserError("nothing to inspect: the text is empty")
    view = nugget_view(load_compressor(args), text)
    if args.html is None:
        auto = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        color = args.color == "always" or (args.color == "auto" and auto)
        print(render_terminal(view, color=color))
    else:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(render_html(view, title=title), encoding="utf-8")
        print(view.summary())
        print(f"wrote {args.html}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .eval.cli import run_from_args

    argv = args.argv[1:] if args.argv and args.argv[0] == "eval" else args.argv
    return run_from_args(args, argv)


def _manifest(index_dir: Path) -> dict:
    from .integrations import read_manifest

    manifest = read_manifest(index_dir)
    if manifest is None:
        raise UserError(f"no index in {index_dir}: run `nugget-rag ingest PATH... --index {index_dir}` first")
    return manifest


# ---------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_checkpoint_option(common)
    common.add_argument("--base-model", type=Path, help="base LLaMA checkpoint directory (default: SmolLM2-135M)")
    common.add_argument("--device", help="torch device, e.g. cpu or cuda (default: cuda if available)")
    add_verbose_option(common)

    parser = argparse.ArgumentParser(prog="nugget-rag", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ingest = commands.add_parser("ingest", parents=[common], help="index and compress documents",
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
    add_store_option(ingest)
    add_vectorstore_option(ingest)
    ingest.set_defaults(func=cmd_ingest)

    ask = commands.add_parser("ask", parents=[common], help="answer a question from an index",
                              description="Retrieve the closest chunks, read their nuggets and stream the answer.")
    ask.add_argument("question")
    ask.add_argument("--index", type=Path, metavar="DIR", help="index directory (default: the index published in "
                     "the Redis of --store)")
    ask.add_argument("--url", help="ask a running `nugget-rag serve` instead, e.g. http://127.0.0.1:8000")
    ask.add_argument("-k", type=positive_int, default=4,
                     help="chunks to retrieve (default 4); --resolution reads, skims or drops each")
    ask.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N", help="answer length (default 128)")
    ask.add_argument("--resolution", choices=RESOLUTIONS, default="default",
                     help=("how each chunk is read: default (the best measured policy), uniform (all as nuggets at "
                           "the index's ratio), or a policy of nugget_rag.resolution with its defaults"))
    add_repetition_options(ask)
    add_weights_option(ask)
    add_store_option(ask)
    add_vectorstore_option(ask)
    ask.set_defaults(func=cmd_ask)

    serve = commands.add_parser("serve", parents=[common], help="serve an index over HTTP",
                                description="A long-running server that keeps the model, index and store warm "
                                            "(nugget_rag/serving/__init__.py lists its endpoints).")
    serve.add_argument("--index", type=Path, metavar="DIR", help="index directory (created if new); without it, "
                       "the index published in the Redis of --store, which /ingest adds to")
    add_text_states_option(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=positive_int, default=8000)
    serve.add_argument("--max-batch", type=positive_int, default=8, metavar="N",
                       help="answers decoded together at most (concurrent requests share batches; default 8)")
    serve.add_argument("--max-pending", type=positive_int, default=32, metavar="N",
                       help="requests in flight before the server answers 503 (default 32)")
    serve.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, metavar="N",
                       help="largest request body (default 1 MiB)")
    serve.add_argument("--request-timeout", type=positive_float, default=600, metavar="SECONDS",
                       help="a request still under way after this long stops: 504 (default 600)")
    serve.add_argument("--max-ingest-documents", type=positive_int, default=100, metavar="N",
                       help="documents one /ingest or /compress request takes at most (413 beyond; larger ingests: "
                            "POST /ingest/jobs, in the background; default 100)")
    serve.add_argument("--api-key", metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' on every path but /health (default: ${API_KEY_ENV}; "
                            "the variable keeps the key out of the process list)")
    serve.add_argument("--ray", nargs="?", const="local", type=ray_address, metavar="ADDRESS",
                       help="serve from replicas on a Ray cluster (the [ray] extra), each holding one model and "
                            "reading the --store and the index directory: 'auto', HOST:PORT or ray://HOST:PORT; "
                            "without ADDRESS a local one")
    serve.add_argument("--replicas", type=replica_range, metavar="N|MIN..MAX",
                       help="with --ray: N replicas, or from MIN to MAX as the load asks (default 1)")
    serve.add_argument("--target-ongoing", type=positive_float, metavar="N",
                       help="with --ray MIN..MAX: requests in flight per replica the autoscaler aims at (default: "
                            "--max-batch)")
    serve.add_argument("--cpus-per-replica", type=positive_float, metavar="C",
                       help="with --ray: CPUs each replica takes, and its torch threads (default 1)")
    serve.add_argument("--gpus-per-replica", type=positive_float, metavar="G",
                       help="with --ray: GPUs each replica takes (default 0)")
    add_weights_option(serve)
    add_store_option(serve)
    add_vectorstore_option(serve)
    serve.set_defaults(func=cmd_serve)

    jobs = commands.add_parser("jobs", parents=[common], help="list or resume the ingest jobs of servers",
                               description="The background ingest jobs (POST /ingest/jobs) recorded in an index's "
                                           "nugget store: list them, or resume one whose server stopped, in this "
                                           "process (what it had ingested is skipped).")
    jobs.add_argument("action", choices=["list", "resume"])
    jobs.add_argument("id", nargs="?", metavar="ID", help="the job to resume (ingest-...)")
    jobs.add_argument("--index", type=Path, metavar="DIR", help="the index directory of the jobs' server (without "
                      "it: the index published in --store)")
    jobs.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    add_text_states_option(jobs)
    add_store_option(jobs)
    add_vectorstore_option(jobs)
    jobs.set_defaults(func=cmd_jobs)

    index = commands.add_parser("index", help="check or repair the index published in a store",
                                description="The index published in a --store (ingest/serve --store without "
                                            "--index): check every version, segment and count, or repair them.")
    index_check = index.add_subparsers(dest="action", required=True, metavar="ACTION").add_parser(
        "check", help="check every version the pointer names; --repair mends them",
        description="Check the published index: every version, segment (present, checksum), count, chunk id, and "
                    "the nugget states its chunks name; exit 1 while anything is broken. --repair writes a damaged "
                    "segment again from a verified copy (this machine's cache, another version), else publishes a "
                    "version without the lost chunks and lists their sources to ingest again.")
    index_check.add_argument("--store", type=redis_store, required=True, metavar="REDIS_URL",
                             help="the store the index is published in")
    index_check.add_argument("--name", default="default", help="the published index's name (default: default)")
    index_check.add_argument("--repair", action="store_true", help="mend what is broken (takes the publish lock)")
    index_check.add_argument("--wait", type=positive_float, default=60, metavar="SECONDS",
                             help="with --repair: how long to wait for another publisher's lock (default 60)")
    add_verbose_option(index_check)
    index_check.set_defaults(func=cmd_index)

    refloor = commands.add_parser("refloor", parents=[common], help="keep fewer nuggets of each indexed chunk",
                                  description="Cut every stored state of an index to a coarser floor: the store "
                                              "keeps only the nuggets of readings at r >= KEEP_RATIO (the default "
                                              "policy reads r >= 4). Stop servers on the index first.")
    refloor.add_argument("--index", type=Path, required=True, metavar="DIR", help="index directory")
    refloor.add_argument("--keep-ratio", type=ratio_arg, required=True, metavar="R",
                         help="the new floor, coarser than the index's (e.g. 4, what the default policy reads)")
    refloor.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_store_option(refloor)
    add_vectorstore_option(refloor)
    refloor.set_defaults(func=cmd_refloor)

    prune = commands.add_parser("prune", help="remove stored nuggets no index references",
                                description="Remove the nugget states in the index's store that no index over "
                                            "that store references (after `delete`s, re-chunking, other models). "
                                            "Every index saved over a shared --store is read and kept; one "
                                            "another host holds makes prune refuse.")
    prune.add_argument("--index", type=Path, required=True, metavar="DIR", help="index directory")
    add_store_option(prune)
    add_verbose_option(prune)
    prune.set_defaults(func=cmd_prune)

    inspect = commands.add_parser("inspect", parents=[common], help="show which tokens become nuggets",
                                  description="Highlight the tokens the Scorer keeps as nuggets (Dodo paper, Fig. 7).")
    inspect.add_argument("text", metavar="TEXT_OR_FILE", help="a file to read, or the text itself")
    inspect.add_argument("--ratio", type=ratio_arg, help="compression ratio r (default: the model's)")
    inspect.add_argument("--html", type=Path, metavar="OUT.html", help="write an HTML page instead of printing")
    inspect.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                         help="terminal highlighting (never: nuggets in [[brackets]])")
    inspect.set_defaults(func=cmd_inspect)

    from .eval import cli as eval_cli
    from .train import cli as train_cli

    train = commands.add_parser("train", help="train the nugget adapters and Scorer", description=train_cli.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train_cli.add_arguments(train)
    add_verbose_option(train)
    train.set_defaults(func=lambda args: train_cli.run_from_args(args))

    evaluate = commands.add_parser("eval", help="evaluate compression systems on the paper's tasks",
                                   description="Evaluation harness: tasks x systems x ratios, speed and memory; "
                                               "writes JSON, a markdown table and plots.")
    eval_cli.add_arguments(evaluate)
    add_verbose_option(evaluate)
    evaluate.set_defaults(func=cmd_eval)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed by argparse
        return int(exit_.code or 0)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    level = logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose or args.command == "train" else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s" if args.command == "train"
                        else "%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError, OSError, ImportError) as err:
        log.debug("details", exc_info=True)
        print(f"nugget-rag {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["build_parser", "load_compressor", "load_embeddings", "load_vectorstore", "main", "vectorstore_spec"]

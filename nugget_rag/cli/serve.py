"""`nugget-rag serve`: serve an index over HTTP (nugget_rag.serving), from this process or from replicas on Ray."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import threading
from pathlib import Path

from . import loading
from .opening import open_index
from .options import (
    API_KEY_ENV,
    UserError,
    add_stores_options,
    add_text_states_option,
    add_weights_option,
    positive_float,
    positive_int,
    ray_address,
    replica_range,
)


def register(commands: argparse._SubParsersAction, model_options: argparse.ArgumentParser) -> None:
    serve = commands.add_parser("serve", parents=[model_options], help="serve an index over HTTP",
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
    add_stores_options(serve)
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..serving import create_app

    if args.ray is not None:
        from ..integrations.ingest.ray import connect
        from ..serving.ray_serve import REPLICA_NICENESS

        replicas = args.replicas or (1, None)
        # an unreachable cluster fails here, before any work
        connect(None if args.ray == "local" else args.ray, worker_niceness=REPLICA_NICENESS)
    elif args.replicas or args.cpus_per_replica or args.gpus_per_replica or args.target_ongoing:
        raise UserError("--replicas, --target-ongoing, --cpus-per-replica and --gpus-per-replica are for serving on "
                        "Ray: add --ray [ADDRESS]")
    if args.index is None and args.store is None:
        raise UserError("serve needs --index DIR (created if new), or --store REDIS_URL to serve the index published "
                        "there")
    opened = open_index(args)
    index = opened.published() if opened.directory is None else opened.open()
    where = args.index or f"the index published in {args.store}"
    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    settings = {"max_pending": args.max_pending, "max_body_bytes": args.max_body_bytes, "max_batch": args.max_batch,
                "request_timeout_s": args.request_timeout, "api_key": key,
                "max_ingest_documents": args.max_ingest_documents}
    if key is None and not loopback(args.host):
        print(f"warning: serving on {args.host} without an API key: whoever reaches the port can ask, and write to "
              f"the index through /ingest; set {API_KEY_ENV} or --api-key", file=sys.stderr, flush=True)
    if args.ray is not None:
        from ..serving.ray_serve import RayServeOptions, serve_index

        options = RayServeOptions(min_replicas=replicas[0], max_replicas=replicas[1], host=args.host, port=args.port,
                                  target_ongoing_requests=args.target_ongoing or args.max_batch,
                                  cpus_per_replica=args.cpus_per_replica or 1.0,
                                  gpus_per_replica=args.gpus_per_replica or 0.0,
                                  graceful_shutdown_timeout_s=args.request_timeout)
        url = serve_index(args.index, index.compressor, index.embeddings, options,
                          model=loading.ray_model_loader(args), vectorstore=opened.vectorstore_spec, **settings)
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


def wait_for_interrupt() -> None:
    """Block until Ctrl-C or SIGTERM (the Ray replicas serve meanwhile), then delete the deployment."""
    from ray import serve

    from ..serving.ray_serve import APP_NAME

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop (systemd, Kubernetes) as Ctrl-C
    try:
        threading.Event().wait()
    finally:
        serve.delete(APP_NAME)


def loopback(host: str) -> bool:
    """Whether `host` is this machine only (localhost, 127.0.0.1, ::1)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False

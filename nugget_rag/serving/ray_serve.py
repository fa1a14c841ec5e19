"""`nugget-rag serve --ray`: the HTTP server (nugget_rag.serving) as a Ray Serve deployment of model replicas.

    connect("head:6379")
    serve_index(index_dir, compressor, embeddings, RayServeOptions(min_replicas=2, max_replicas=8), model=loader)

Every replica loads one model (`ModelLoader`, as an ingest worker does) and refuses to start when its fingerprint is
not the driver's; the driver itself refuses an index whose nuggets another model made, before any replica starts.
The replicas read one shared nugget store (Redis, or a directory every node sees) and the index either published
in that store (`index_dir=None`: integrations/published/; each replica needs only the store's URL) or in one index
directory (a filesystem every node mounts at the same path). Before each use a replica checks the published pointer
(one small read) or the directory's manifest (one stat); when another replica's ingest replaced it, it loads the new
version, so an ingest through any replica is seen by all. POST /ingest (and its background jobs) runs the ingest
pipeline's ingest, compressing on Ray Data (RayCompression), then publishes (or saves, under the directory's lock).

Routes, API key, streaming and OpenAI compatibility are the single-process server's; /health and /metrics describe
the replica that answered, named by every response's `x-nugget-replica` header. With `max_replicas`, Serve scales
between the bounds on the requests in flight per replica (`target_ongoing_requests`); a replica being replaced
(an update, a scale-down) takes no new request and finishes those it has, for up to `graceful_shutdown_timeout_s`.
A Ray started here (no address) runs the replicas at the driver's priority, not Ray's lowered one for workers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..cancellation import Stop
from ..components.compressor import NuggetCompressor
from ..config import MergedFormat
from ..integrations.ingest.pipeline import ingest
from ..integrations.ingest.ray import (
    COMPRESSOR_SETTINGS,
    ModelLoader,
    ModelMismatchError,
    RayCompression,
    RayIngestOptions,
    connect,
    shared_location,
)
from ..integrations.local.files import MANIFEST_FILE, IndexFileError
from ..integrations.local.index import NuggetIndex, ingest_into_directory
from ..integrations.published.index import PublishedIndex
from ..integrations.published.named import NamedIndex
from ..integrations.stores.spec import VectorStoreSpec
from ..model import NuggetModel
from ..state.store import StoreLocation
from .app import create_app

try:
    import ray
    from ray import serve
except ImportError as err:  # an extra
    raise ImportError(f"{err.name} is not installed: serving on Ray needs nugget-rag's [ray] extra "
                      "(pip install 'nugget-rag[ray]')") from err

log = logging.getLogger(__name__)

APP_NAME = "nugget-rag"
REPLICA_HEADER = "x-nugget-replica"
# A Ray started here runs its workers, the replicas among them, at this niceness: they are the server. At Ray's
# default (15) any other CPU-bound process starves them (the kill test under stress_suite.sh took 15+ min a run).
REPLICA_NICENESS = 0


class RayServeOptions(BaseModel):
    """How many replicas serve, what each takes, and where Serve listens."""

    address: str | None = Field(None, description="the Ray cluster (as RayIngestOptions.address); None: the Ray "
                                "this process runs, else a new local one")
    min_replicas: int = Field(1, ge=1, description="replicas at least (and at start)")
    max_replicas: int | None = Field(None, ge=1, description="replicas at most, Serve scaling between the bounds on "
                                     "the requests in flight; None: min_replicas, fixed")
    target_ongoing_requests: float = Field(8, gt=0, description="requests in flight per replica the autoscaler "
                                           "aims at (the server's max_batch decodes together)")
    cpus_per_replica: float = Field(1.0, gt=0, description="CPUs each replica takes (and its torch threads, at "
                                    "least 1)")
    gpus_per_replica: float = Field(0.0, ge=0)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    graceful_shutdown_timeout_s: float = Field(600, gt=0, description="how long a replica being stopped finishes "
                                               "the answers it has (the server's request timeout)")

    @model_validator(mode="after")
    def _ordered(self) -> RayServeOptions:
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas={self.max_replicas} is below min_replicas={self.min_replicas}; give "
                             "MIN..MAX with MIN <= MAX")
        return self

    def deployment_options(self, max_pending: int) -> dict[str, Any]:
        """Serve's deployment options; a replica takes up to `max_pending` requests, as the server admits."""
        if self.max_replicas is None:
            scale: dict[str, Any] = {"num_replicas": self.min_replicas}
        else:
            scale = {"autoscaling_config": {"min_replicas": self.min_replicas, "initial_replicas": self.min_replicas,
                                            "max_replicas": self.max_replicas,
                                            "target_ongoing_requests": self.target_ongoing_requests}}
        return {**scale, "max_ongoing_requests": max_pending,
                "ray_actor_options": {"num_cpus": self.cpus_per_replica, "num_gpus": self.gpus_per_replica},
                "graceful_shutdown_wait_loop_s": 1.0,
                "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s}


class ReplicaSpec(BaseModel):
    """What each replica loads: the model, the driver compressor's settings and fingerprint, the store, the index
    directory (None: the index published in the store), embeddings and vector store (None: the index's own FAISS),
    create_app's arguments, and how its ingests run."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    load_model: Callable[[], NuggetModel]
    settings: dict[str, Any]
    weights: MergedFormat
    fingerprint: str
    store: StoreLocation
    index_dir: str | None
    embeddings: Embeddings
    vectorstore: VectorStoreSpec | None = None
    app: dict[str, Any]
    threads: int = Field(1, ge=1)
    ingest: RayIngestOptions


# ---------------------------------------------------------------------------------------------- a replica
class ReplicaIndex:
    """A replica's served index over a directory every node mounts (nugget_rag.serving's ServedIndex): each use reads
    the index saved last (the manifest's stat tells; it is replaced whole on every save); an ingest runs on Ray Data
    under the directory's lock, and every replica reads its result once saved."""

    def __init__(self, spec: ReplicaSpec, compressor: NuggetCompressor, vectorstore: VectorStore | None = None):
        self.spec, self.compressor, self.embeddings = spec, compressor, spec.embeddings
        self.directory = Path(spec.index_dir)
        self.location = str(spec.index_dir)
        self.user_vectorstore = vectorstore
        self._lock = threading.Lock()
        self._stamp: tuple | None = ()
        self._index: NuggetIndex | None = None
        self.current()

    def current(self) -> NuggetIndex:
        """The index as saved last: loaded again when its manifest changed since."""
        stamp = self._manifest_stamp()
        with self._lock:
            if stamp != self._stamp or self._index is None:
                self._index, self._stamp = self._load(), stamp
            return self._index

    def _manifest_stamp(self) -> tuple | None:
        try:
            found = (self.directory / MANIFEST_FILE).stat()
        except FileNotFoundError:
            return None
        return found.st_ino, found.st_mtime_ns, found.st_size

    def _load(self) -> NuggetIndex:
        for attempt in range(3):  # a save may delete the files the manifest read a moment ago named
            try:
                index = NuggetIndex.open(self.directory, self.compressor, self.embeddings,
                                         vectorstore=self.user_vectorstore)
                break
            except (FileNotFoundError, IndexFileError):
                if attempt == 2:
                    raise
        if index.compressor.fingerprint != self.compressor.fingerprint:
            raise ModelMismatchError(f"the index in {self.directory} was opened with another compressor than the "
                                     "replica's (another store or nugget floor)")
        log.info("loaded the index in %s: %d chunks", self.directory, len(index))
        return index

    def ingest(self, documents: list[Document], stop: Stop) -> int:
        index = self.current()
        settings = {"chunk_tokens": index.chunk_tokens, "chunk_overlap": index.chunk_overlap,
                    "vectorstore": self.user_vectorstore}
        _, added = ingest_into_directory(self.directory, self.compressor, self.embeddings, documents, stop,
                                         partial(ingest_on_ray, self.spec), **settings)  # stopped: not saved
        self.current()  # this replica's next answer reads it
        return added

    def __len__(self) -> int:
        return len(self.current())


def ingest_on_ray(spec: ReplicaSpec, index: NuggetIndex, documents: list[Document], stop: Stop | None = None) -> int:
    """A replica's ingest: the ingest pipeline's, into `index`, compressing on Ray Data with the workers that start now."""
    options = spec.ingest
    free = ray.available_resources().get("GPU" if options.gpus_per_worker else "CPU", 0)
    workers = max(1, int(free // (options.gpus_per_worker or options.cpus_per_worker)))  # those that start now
    stage = RayCompression(options.model_copy(update={"workers": workers}), spec.load_model)
    return ingest(index, documents, stop, stage=stage)


class NuggetReplica:
    """A Serve replica: one model, the shared store and index, and nugget_rag.serving's server over them."""

    def __init__(self, spec: ReplicaSpec):
        torch.set_num_threads(spec.threads)
        compressor = NuggetCompressor(model=spec.load_model(), store=spec.store.open(), **spec.settings)
        compressor.model.merged_format = spec.weights
        if compressor.fingerprint != spec.fingerprint:
            raise ModelMismatchError(
                f"this replica's nugget model ({compressor.model.base_name}, fingerprint {compressor.fingerprint}) is "
                f"not the driver's (fingerprint {spec.fingerprint}); load the driver's checkpoint, base model and "
                "dtype on every node (--checkpoint/--base-model)")
        self.spec = spec
        if spec.index_dir is None:  # the index published in the store: each replica reads its newest version
            self.index: ReplicaIndex | PublishedIndex = PublishedIndex(compressor, spec.embeddings,
                                                                       pipeline=partial(ingest_on_ray, spec))
        else:
            vectorstore = None if spec.vectorstore is None else spec.vectorstore.build(spec.embeddings)
            self.index = ReplicaIndex(spec, compressor, vectorstore)
        self.name = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):
        return _named(create_app(self.index, **self.spec.app), self.name)


def _named(app, replica: str):
    """`app`, every response of which names the replica in REPLICA_HEADER."""
    header = (REPLICA_HEADER.encode(), replica.encode())

    async def named(scope, receive, send):
        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await app(scope, receive, send_named)

    return named


# ---------------------------------------------------------------------------------------------- the driver
def check_index_model(index_dir: str | Path | None, compressor: NuggetCompressor) -> None:
    """Refuse to serve an index (None: the one published in the compressor's store) whose nuggets another model (or
    ratio, or floor) made: a ModelMismatchError naming both. An index with no chunks yet takes any model."""
    named = NamedIndex(index_dir, compressor.store)
    manifest, where = named.manifest() or {}, named.where
    saved = manifest.get("nugget_fingerprint")
    if manifest.get("count") and saved != compressor.fingerprint:
        raise ModelMismatchError(
            f"{where} holds nuggets of {manifest.get('nugget_model')} at r = {manifest.get('ratio')} "
            f"(fingerprint {saved}), not of the model given ({compressor.model.base_name}, fingerprint "
            f"{compressor.fingerprint}); serve it with the checkpoint and base model it was ingested with, or "
            "ingest into a new index directory")


def replica_spec(index_dir: str | Path | None, compressor: NuggetCompressor, embeddings: Embeddings,
                 options: RayServeOptions, model: ModelLoader | Callable[[], NuggetModel],
                 app: dict[str, Any], vectorstore: VectorStoreSpec | None = None) -> ReplicaSpec:
    """What each replica loads, for the driver's compressor (its store must be one the replicas reach)."""
    if isinstance(model, ModelLoader) and model.dtype is None:
        model = model.model_copy(update={"dtype": str(compressor.model.dtype).removeprefix("torch.")})
    threads = max(1, int(options.cpus_per_replica))
    return ReplicaSpec(
        load_model=model, settings={name: getattr(compressor, name) for name in COMPRESSOR_SETTINGS},
        weights=compressor.model.merged_format, fingerprint=compressor.fingerprint,
        store=shared_location(compressor.store), embeddings=embeddings,
        index_dir=None if index_dir is None else str(Path(index_dir).resolve()),
        vectorstore=vectorstore, app=app, threads=threads,
        ingest=RayIngestOptions(cpus_per_worker=options.cpus_per_replica,
                                gpus_per_worker=options.gpus_per_replica, threads_per_worker=threads))


def serve_index(index_dir: str | Path | None, compressor: NuggetCompressor, embeddings: Embeddings,
                options: RayServeOptions, model: ModelLoader | Callable[[], NuggetModel] | None = None,
                vectorstore: VectorStoreSpec | None = None, **app: Any) -> str:
    """Serve the index in `index_dir` (None: the one published in the compressor's store) from replicas on the Ray
    cluster (create_app's keyword arguments in `app`, but its index and index_dir); `vectorstore`: the user's vector
    store each replica builds and reads (one they all reach: a server, not memory), None for the index's own FAISS;
    returns the URL. Refused before any replica
    starts: an index of another model, a store the replicas cannot reach, an unreachable cluster. Returns once the
    replicas answer; `serve.delete(APP_NAME)` stops them."""
    check_index_model(index_dir, compressor)
    spec = replica_spec(index_dir, compressor, embeddings, options, model or ModelLoader(), app, vectorstore)
    connect(options.address, worker_niceness=REPLICA_NICENESS)
    if spec.store.directory is not None and len(ray.nodes()) > 1:
        log.warning("the nuggets are in the directory %s: every node must see it (a shared filesystem), else use a "
                    "Redis store", spec.store.directory)
    serve.start(http_options={"host": options.host, "port": options.port})
    deployment = serve.deployment(serve.ingress()(NuggetReplica), name="NuggetReplica")
    deployment = deployment.options(**options.deployment_options(app.get("max_pending", 32)))
    serve.run(deployment.bind(spec), name=APP_NAME, route_prefix="/")
    return f"http://{options.host}:{options.port}"


__all__ = ["APP_NAME", "REPLICA_HEADER", "NuggetReplica", "RayServeOptions", "ReplicaIndex", "ReplicaSpec",
           "check_index_model", "ingest_on_ray", "replica_spec", "serve_index"]

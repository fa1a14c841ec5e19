"""Distributed ingest on Ray Data: pipeline.py's ingest, whose compress stage runs on a pool of actors, each
holding one nugget model, compressing into one shared store.

    with NuggetIndex.updating("my-index", NuggetCompressor.from_pretrained(store=NuggetStore.from_redis(URL))) as index:
        ingest_distributed(index, ["corpus/"], RayIngestOptions(address="head:6379", gpus_per_worker=1))

The driver reads the input (files and folders as `nugget-rag ingest` does, Documents, or a Ray Dataset of
{"text", "id", "title", "source"} rows), splits it and drops the chunks already indexed (the pipeline's split and
de-duplicate), then sends the new chunks in batches to a fixed pool of actors (`map_batches` with
`ActorPoolStrategy`): RayCompression, the pipeline's compress stage. Each actor loads its model once (`ModelLoader`),
refuses to start when the model's fingerprint is not the driver's (so a store never mixes models), and runs the
pipeline's compress (straight into the shared store: Redis, or a directory every node sees) and embed. The driver
adds the chunks and vectors to the index in the chunks' order: the index a single-process ingest builds.
A state already in the store is read, never recomputed: a rerun after a crash computes only what is missing, and a
killed worker is restarted by Ray, which retries its batch.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tqdm.auto import tqdm

from nugget_rag.cancellation import Stop, check
from nugget_rag.components.compressor import METADATA_KEY, NuggetCompressor
from nugget_rag.config import RAY_ADDRESS
from nugget_rag.model import NuggetModel
from nugget_rag.model.checkpoint_files import DEFAULT_CHECKPOINT
from nugget_rag.state.store import NuggetStore, StoreLocation, StoreUnavailableError

from .loaders import read_documents
from .pipeline import IngestTarget, compress, embed, ingest

try:
    import ray
    import ray.data
except ImportError as err:  # an extra
    raise ImportError(f"{err.name} is not installed: distributed ingest needs nugget-rag's [ray] extra "
                      "(pip install 'nugget-rag[ray]')") from err

log = logging.getLogger(__name__)

# The compressor settings a worker takes from the driver's compressor (its model it loads itself).
COMPRESSOR_SETTINGS = ("ratio", "keep_ratio", "batch_size", "segment_tokens", "kv_format", "text_states")
ADD_BATCH = 1024  # chunks the driver adds to the index at a time


class RayClusterError(ConnectionError):
    """The Ray cluster named cannot be reached."""


class ModelMismatchError(ValueError):
    """A worker loaded another model than the driver's (its states would carry another fingerprint)."""


class ModelLoader(BaseModel):
    """How each worker loads its NuggetModel: `NuggetModel.from_pretrained`'s arguments, as every node names them.

    `dtype` defaults to the driver model's (a state's fingerprint names its dtype); `device` to cuda where the worker
    has a GPU.
    """

    model_config = ConfigDict(frozen=True)

    checkpoint: str | None = Field(DEFAULT_CHECKPOINT, description="checkpoint directory, 'default' or None")
    base_model: str | None = Field(None, description="base LLaMA checkpoint directory (default: SmolLM2-135M)")
    device: str | None = None
    dtype: str | None = None

    @field_validator("checkpoint", "base_model", mode="before")
    @classmethod
    def _as_text(cls, value: object) -> object:
        return str(value) if isinstance(value, Path) else value

    def __call__(self) -> NuggetModel:
        return NuggetModel.from_pretrained(self.checkpoint, base_model=self.base_model, device=self.device,
                                           dtype=self.dtype)


def shared_location(store: NuggetStore) -> StoreLocation:
    """Where `store` lives, for the workers; a ValueError when they cannot open it (memory, another ByteStore)."""
    location = store.location
    if location is None:
        kind = "memory" if store.byte_store is None else type(store.byte_store).__name__
        raise ValueError(f"the Ray workers cannot reach the compressor's store ({kind}); give the compressor a store "
                         "they share: NuggetStore.from_redis(URL), or a directory (NuggetIndex.updating(DIR, ...))")
    return location


class RayIngestOptions(BaseModel):
    """Where and how wide a distributed ingest runs."""

    address: str | None = Field(None, description="the Ray cluster: 'auto', HOST:PORT or ray://HOST:PORT; None: the "
                                "Ray this process already runs, else a new local one")
    workers: int | None = Field(None, ge=1, description="actors, each with one model (default: as many as the "
                                "cluster's CPUs, or GPUs with gpus_per_worker, hold)")
    cpus_per_worker: float = Field(1.0, gt=0)
    gpus_per_worker: float = Field(0.0, ge=0)
    threads_per_worker: int = Field(1, ge=1, description="torch threads in each worker")
    chunks_per_batch: int | None = Field(None, ge=1, description="chunks a worker takes at a time (one Ray batch; "
                                         "default: a quarter of each worker's share, 1 to 64)")

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str | None) -> str | None:
        if value is None or value == "auto" or RAY_ADDRESS.fullmatch(value):
            return value
        raise ValueError(f"{value!r} is not a Ray address: give 'auto', HOST:PORT (the head's GCS port, 6379 by "
                         "default) or ray://HOST:PORT (Ray Client, 10001)")


# ---------------------------------------------------------------------------------------------- the driver
def connect(address: str | None, worker_niceness: int | None = None, **init: Any) -> None:
    """Join the Ray cluster at `address` (checked first, so an unreachable one is an error naming it at once), or
    start one here where there is none (no address, no RAY_ADDRESS): then `init` goes to `ray.init`, and
    `worker_niceness` (Ray's default 15) sets its workers' priority."""
    match = RAY_ADDRESS.fullmatch(address or "")
    if match:
        host, port = match["host"].strip("[]"), int(match["port"])
        try:
            socket.create_connection((host, port), timeout=5).close()
        except OSError as err:
            raise RayClusterError(f"cannot reach the Ray cluster at {address} ({err.strerror or err}); start it there "
                                  "(`ray start --head`) or fix the address") from None
    if ray.is_initialized():
        if address is not None:
            log.warning("Ray is already running in this process; using it, not %s", address)
        return
    if address is None and not os.environ.get("RAY_ADDRESS") and worker_niceness is not None:
        init["_system_config"] = {"worker_niceness": worker_niceness}
    try:
        ray.init(address=address, **{"logging_level": logging.WARNING, "configure_logging": False, **init})
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise RayClusterError(f"cannot connect to the Ray cluster at {address}: {err}") from err


def ingest_distributed(
    index: IngestTarget,
    data: ray.data.Dataset | Sequence[str | Path] | Sequence[Document],
    options: RayIngestOptions | None = None,
    model: ModelLoader | Callable[[], NuggetModel] | None = None,
    stop: Stop | None = None,
) -> int:
    """`index.ingest` on a Ray cluster: pipeline.py's ingest of `data` (file and folder paths, Documents, or a
    Ray Dataset), compressing on the Ray workers into the shared store (RayCompression); returns the new chunks.

    `model` is what each worker loads (default `ModelLoader()`: the default checkpoint, in the driver model's dtype);
    a worker whose model is not the driver's is refused before it writes. Chunks already indexed are skipped; files
    that are empty or cannot be read are skipped and named in `index.last_ingest["skipped_files"]`. Progress is
    shown with `index.show_progress`; `stop` as the pipeline's.
    """
    options = options or RayIngestOptions()
    shared_location(index.compressor.store)  # before any work: the workers must reach the store
    connect(options.address)
    documents, skipped_files = read_input(data)
    for path, reason in skipped_files.items():
        log.warning("skipped %s: %s", path, reason)
    added = ingest(index, documents, stop, stage=RayCompression(options, model))
    index.last_ingest["skipped_files"] = skipped_files
    log.info("compressed %(computed)d states on %(workers)d Ray workers (the rest were in the store)",
             index.last_ingest)
    return added


def read_input(data: Any) -> tuple[list[Document], dict[str, str]]:
    """The documents of `data` (a Ray Dataset's rows read here), and the files skipped, with why."""
    if isinstance(data, ray.data.Dataset):
        with _quiet_ray_data():
            return [_row_document(row) for row in data.iter_rows()], {}
    items = [data] if isinstance(data, (str, Path)) else list(data)
    if all(isinstance(item, Document) for item in items):
        return items, {}
    if all(isinstance(item, (str, Path)) for item in items):
        docs, skipped = read_documents(items)
        return docs, skipped
    raise TypeError("ingest_distributed takes file or folder paths, Documents, or a Ray Dataset; got "
                    f"{', '.join(sorted({type(item).__name__ for item in items}))}")


def _row_document(row: dict[str, Any]) -> Document:
    """A Dataset's row as a Document: its "text", and its "id", "title", "source" (as a JSONL line's fields)."""
    meta = {k: str(row[k]) for k in ("id", "title", "source") if row.get(k) is not None}
    if meta.get("id") or meta.get("source"):
        meta["source"] = meta.get("id") or meta["source"]
    return Document(page_content=str(row["text"]), metadata=meta)


class RayCompression:
    """pipeline.py's compress stage on a Ray cluster: a fixed pool of CompressWorker actors (`options`; each
    loads `model`, default `ModelLoader()`) compresses the chunks into the shared store and embeds them; the batches
    come back in the chunks' order. `stats`: the workers, the states computed (the rest were in the store), the
    seconds until the first results came ("startup_seconds": Ray, loading the models, a first batch) and the tokens/s
    from then on ("running_tokens_per_s", once every worker runs; None with one batch)."""

    def __init__(self, options: RayIngestOptions, model: ModelLoader | Callable[[], NuggetModel] | None = None):
        self.options, self.model = options, model if model is not None else ModelLoader()
        self.stats: dict[str, Any] = {}

    def __call__(self, index: IngestTarget, chunks: list[Document]) -> Iterator[tuple[list[Document], list]]:
        location = shared_location(index.compressor.store)
        if location.directory is not None and len(ray.nodes()) > 1:
            log.warning("the nuggets go to the directory %s: every node of the cluster must see it (a shared "
                        "filesystem), else use a Redis store", location.directory)
        workers = self.options.workers or _default_workers(self.options)
        self.stats = {"workers": workers, "computed": 0, "startup_seconds": None, "running_tokens_per_s": None}
        if not chunks:
            return
        results = sorted(self._run(index, chunks, workers, location), key=lambda result: int(result.position))
        self.stats["computed"] = sum(int(result.computed) for result in results)
        for start in range(0, len(results), ADD_BATCH):
            part = [(chunks[int(r.position)], r) for r in results[start : start + ADD_BATCH]]
            yield ([Document(id=chunk.id, page_content=chunk.page_content, metadata=json.loads(r.metadata))
                    for chunk, r in part],
                   [np.frombuffer(r.vector, dtype=np.float32) for _, r in part])

    def _worker_args(self, index: IngestTarget, location: StoreLocation) -> dict[str, Any]:
        """CompressWorker's arguments: the model to load, the driver compressor's settings and fingerprint, the
        store and the embeddings (sent to each worker; SentenceTransformerEmbeddings as their path)."""
        loader, compressor = self.model, index.compressor
        if isinstance(loader, ModelLoader) and loader.dtype is None:
            loader = loader.model_copy(update={"dtype": str(compressor.model.dtype).removeprefix("torch.")})
        return {"load_model": loader, "settings": {name: getattr(compressor, name) for name in COMPRESSOR_SETTINGS},
                "store": location, "embeddings": index.embeddings, "fingerprint": compressor.fingerprint,
                "threads": self.options.threads_per_worker}

    def _run(self, index: IngestTarget, chunks: list[Document], workers: int,
             location: StoreLocation) -> list[ChunkResult]:
        """Run the actor pool over the chunks: each chunk's result, as they come, with a progress bar."""
        results: list[ChunkResult] = []
        started, first = time.perf_counter(), None  # when the first results came, and their tokens
        bar = tqdm(total=len(chunks), desc=f"ingesting on {workers} Ray workers", unit="chunk",
                   disable=not index.show_progress)
        rows = [{"position": i, "text": c.page_content, "metadata": json.dumps(c.metadata)}
                for i, c in enumerate(chunks)]
        try:
            with _quiet_ray_data():
                batch_size = self.options.chunks_per_batch or min(64, max(1, len(rows) // (4 * workers)))
                blocks = max(1, math.ceil(len(rows) / batch_size))  # a batch a block, spread over the workers
                compressed = ray.data.from_items(rows, override_num_blocks=blocks).map_batches(
                    CompressWorker, batch_size=batch_size, batch_format="numpy",
                    compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=self.options.cpus_per_worker,
                    num_gpus=self.options.gpus_per_worker or None, udf_modifying_row_count=False,
                    fn_constructor_kwargs=self._worker_args(index, location),
                )
                for batch in compressed.iter_batches(batch_size=None, batch_format="numpy"):
                    check()  # a cancelled ingest stops here, before anything is added
                    results += [ChunkResult(*row) for row in zip(*(batch[name] for name in ChunkResult._fields))]
                    now, tokens = time.perf_counter(), sum(int(r.tokens) for r in results)
                    first = first or (now, tokens)
                    bar.update(len(batch["position"]))
                    bar.set_postfix_str(f"{tokens / (now - started):.0f} tokens/s", refresh=False)
        except Exception as err:
            cause = _worker_error(err)
            if cause is err:
                raise
            raise cause from err
        finally:
            bar.close()
        running = (tokens - first[1]) / (now - first[0]) if first and now > first[0] else None
        self.stats.update(startup_seconds=round(first[0] - started, 3) if first else None,
                          running_tokens_per_s=None if running is None else round(running, 1))
        return results


@contextmanager
def _quiet_ray_data() -> Iterator[None]:
    """Ray Data's progress bars and execution logs off for the datasets made inside (the ingest shows its own)."""
    context, logger = ray.data.DataContext.get_current(), logging.getLogger("ray.data")
    saved = context.enable_progress_bars, logger.level
    context.enable_progress_bars = False
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        context.enable_progress_bars = saved[0]
        logger.setLevel(saved[1])


def _default_workers(options: RayIngestOptions) -> int:
    resources = ray.cluster_resources()
    if options.gpus_per_worker:
        return max(1, int(resources.get("GPU", 0) // options.gpus_per_worker))
    return max(1, int(resources.get("CPU", 1) // options.cpus_per_worker))


def _worker_error(err: BaseException) -> BaseException:
    """A worker's own refusal (a model mismatch, an unreachable store) out of Ray's wrapping, else `err`. Ray passes
    on a worker's exception as text (the actor's death names it, with its traceback): it is found there."""
    seen: BaseException | None = err
    while seen is not None:
        found = re.findall(r"(ModelMismatchError|StoreUnavailableError): (.+)", str(seen))
        if found:
            kind, message = found[-1]
            return (ModelMismatchError if kind == "ModelMismatchError" else StoreUnavailableError)(message)
        seen = seen.__cause__ or seen.__context__
    return err


# ---------------------------------------------------------------------------------------------- the workers
class ChunkResult(NamedTuple):
    """What a worker returns for one chunk (one output row): its place among the chunks sent, its metadata with its
    nuggets (JSON), its float32 vector, whether its state was computed (else it was in the store) and its tokens."""

    position: int
    metadata: str
    vector: bytes
    computed: int
    tokens: int


class CompressWorker:
    """A Ray Data actor: loads one model, then runs the pipeline's compress (into the shared store) and embed on
    batches of chunks."""

    def __init__(self, load_model: Callable[[], NuggetModel], settings: dict[str, Any], store: StoreLocation,
                 embeddings: Embeddings, fingerprint: str, threads: int):
        torch.set_num_threads(threads)
        compressor = NuggetCompressor(model=load_model(), store=store.open(), **settings)
        if compressor.fingerprint != fingerprint:
            raise ModelMismatchError(
                f"this worker's nugget model ({compressor.model.base_name}, fingerprint {compressor.fingerprint}) "
                f"is not the driver's (fingerprint {fingerprint}); it was refused before writing anything. Load the "
                "driver's checkpoint, base model and dtype on every node (ModelLoader, or --checkpoint/--base-model)"
            )
        self.compressor, self.embeddings = compressor, embeddings

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One row a chunk: the batch is compressed together (the compressor's batched passes)."""
        chunks = [Document(page_content=str(text), metadata=json.loads(meta))
                  for text, meta in zip(batch["text"], batch["metadata"])]
        store, fingerprint = self.compressor.store, self.compressor.fingerprint
        missing = {c.page_content for c in chunks if store.get(c.page_content, fingerprint) is None}
        done = compress(self.compressor, chunks)
        vectors = np.asarray(embed(self.embeddings, done), dtype=np.float32)
        computed = []
        for chunk in done:  # a text twice in the batch was compressed once
            computed.append(int(chunk.page_content in missing))
            missing.discard(chunk.page_content)
        out = {"position": batch["position"], "metadata": [json.dumps(d.metadata) for d in done],
               "vector": [v.tobytes() for v in vectors], "computed": computed,
               "tokens": [d.metadata[METADATA_KEY]["n_tokens"] for d in done]}
        return {name: np.array(values, dtype=object) for name, values in out.items()}


__all__ = ["ChunkResult", "CompressWorker", "ModelLoader", "ModelMismatchError", "RayClusterError", "RayCompression",
           "RayIngestOptions", "connect", "ingest_distributed", "read_input", "shared_location"]

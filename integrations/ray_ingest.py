"""Distributed ingest on Ray Data: a pool of actors, each holding one nugget model, compresses into one shared store.

    with NuggetIndex.updating("my-index", NuggetCompressor.from_pretrained(store=NuggetStore.from_redis(URL))) as index:
        ingest_distributed(index, ["corpus/"], RayIngestOptions(address="head:6379", gpus_per_worker=1))

The driver reads the input (files and folders as `nugget-rag ingest` does, Documents, or a Ray Dataset of
{"text", "id", "title", "source"} rows) and sends its documents in batches to a fixed pool of actors (`map_batches`
with `ActorPoolStrategy`). Each actor loads its model once (`ModelLoader`), refuses to start when the model's
fingerprint is not the driver's (so a store never mixes models), splits its documents as `NuggetIndex.split` does,
compresses the chunks straight into the shared store (Redis, or a directory every node sees) and embeds them. The
driver puts the vectors and metadata into the index's vector store (its FAISS, or the user's own) in the documents'
order: the index a single-process ingest builds.
A state already in the store is read, never recomputed: a rerun after a crash computes only what is missing, and a
killed worker is restarted by Ray, which retries its batch.
"""

from __future__ import annotations

import json
import logging
import math
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

from nugget_rag.checkpoint_files import DEFAULT_CHECKPOINT
from nugget_rag.cli_options import RAY_ADDRESS
from nugget_rag.compressor import METADATA_KEY, NuggetCompressor
from nugget_rag.model import NuggetModel
from nugget_rag.store import NuggetStore, StoreLocation, StoreUnavailableError

from .index import NuggetIndex
from .loaders import read_documents

try:
    import ray
    import ray.data
except ImportError as err:  # an extra
    raise ImportError(f"{err.name} is not installed: distributed ingest needs nugget-rag's [ray] extra "
                      "(pip install 'nugget-rag[ray]')") from err

log = logging.getLogger(__name__)

# The compressor settings a worker takes from the driver's compressor (its model it loads itself).
COMPRESSOR_SETTINGS = ("ratio", "keep_ratio", "batch_size", "segment_tokens", "kv_format", "text_states")


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
    documents_per_batch: int | None = Field(None, ge=1, description="documents a worker takes at a time (one Ray "
                                            "batch; default: a quarter of each worker's share, 1 to 16)")

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str | None) -> str | None:
        if value is None or value == "auto" or RAY_ADDRESS.fullmatch(value):
            return value
        raise ValueError(f"{value!r} is not a Ray address: give 'auto', HOST:PORT (the head's GCS port, 6379 by "
                         "default) or ray://HOST:PORT (Ray Client, 10001)")


# ---------------------------------------------------------------------------------------------- the driver
def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` (checked first, so an unreachable one is an error naming it at once)."""
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
    try:
        ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise RayClusterError(f"cannot connect to the Ray cluster at {address}: {err}") from err


def ingest_distributed(
    index: NuggetIndex,
    data: ray.data.Dataset | Sequence[str | Path] | Sequence[Document],
    options: RayIngestOptions | None = None,
    model: ModelLoader | Callable[[], NuggetModel] | None = None,
) -> int:
    """`index.ingest` on a Ray cluster: split, compress (on the Ray workers, into the shared store) and index `data`
    (file and folder paths, Documents, or a Ray Dataset); returns the new chunks.

    `model` is what each worker loads (default `ModelLoader()`: the default checkpoint, in the driver model's dtype);
    a worker whose model is not the driver's is refused before it writes. Chunks already indexed are skipped; files
    that are empty or cannot be read are skipped and named in `index.last_ingest["skipped_files"]`. Progress is
    shown with `index.show_progress`.
    """
    options = options or RayIngestOptions()
    started = time.perf_counter()
    location = shared_location(index.compressor.store)  # before any work: the workers must reach the store
    connect(options.address)
    rows, skipped_files = _rows(data)
    for path, reason in skipped_files.items():
        log.warning("skipped %s: %s", path, reason)
    if location.directory is not None and len(ray.nodes()) > 1:
        log.warning("the nuggets go to the directory %s: every node of the cluster must see it (a shared filesystem), "
                    "else use a Redis store", location.directory)
    workers = options.workers or _default_workers(options)
    results, timing = _compress(index, rows, options, workers, _worker_args(index, location, options, model),
                                started) if not isinstance(rows, list) or rows else ([], {})
    chunks, vectors = _gather(results)
    known, new = set(index.ids), {}
    for chunk, vector in zip(chunks, vectors):
        if chunk.id not in known and chunk.id not in new:
            new[chunk.id] = (chunk, vector)
    todo = list(new.values())
    for start in range(0, len(todo), 1024):
        index.add_chunks([c for c, _ in todo[start : start + 1024]], [v for _, v in todo[start : start + 1024]])
    indexed = sum(int(r.known) for r in results)
    index.last_ingest = {
        "documents": len(results), "chunks": len(chunks) + indexed, "added": len(todo),
        "skipped": len(chunks) + indexed - len(todo), "tokens": sum(c.metadata[METADATA_KEY]["n_tokens"] for c, _ in todo),
        "computed": sum(int(r.computed) for r in results), "workers": workers, "skipped_files": skipped_files,
        "seconds": round(time.perf_counter() - started, 3), **timing,
    }
    log.info("ingested %(documents)d documents on %(workers)d Ray workers: %(chunks)d chunks, %(added)d new, "
             "%(computed)d compressed", index.last_ingest)
    return len(todo)


def _worker_args(index: NuggetIndex, location: StoreLocation, options: RayIngestOptions,
                 model: ModelLoader | Callable[[], NuggetModel] | None) -> dict[str, Any]:
    """CompressWorker's arguments: the model to load, the driver compressor's settings and fingerprint, the chunking,
    the embeddings (sent to each worker; SentenceTransformerEmbeddings as their path) and the chunks indexed."""
    loader = model if model is not None else ModelLoader()
    if isinstance(loader, ModelLoader) and loader.dtype is None:
        loader = loader.model_copy(update={"dtype": str(index.compressor.model.dtype).removeprefix("torch.")})
    compressor = index.compressor
    return {"load_model": loader, "settings": {name: getattr(compressor, name) for name in COMPRESSOR_SETTINGS},
            "store": location, "embeddings": index.embeddings, "chunk_tokens": index.chunk_tokens,
            "chunk_overlap": index.chunk_overlap, "fingerprint": compressor.fingerprint, "known": sorted(index.ids),
            "threads": options.threads_per_worker}


def _compress(index: NuggetIndex, rows: list[dict[str, Any]] | ray.data.Dataset, options: RayIngestOptions,
              workers: int, worker_args: dict[str, Any], started: float) -> tuple[list[DocumentResult], dict]:
    """Run the actor pool over the documents: each document's result, as they come, with a progress bar; and the
    timing: seconds until the first results came ("startup_seconds": Ray, loading the models, a first batch), and
    the tokens/s from then on ("running_tokens_per_s", once every worker runs; None with one batch)."""
    results: list[DocumentResult] = []
    first: tuple[float, int] | None = None  # when the first results came, and their tokens
    total = len(rows) if isinstance(rows, list) else None
    bar = tqdm(total=total, desc=f"ingesting on {workers} Ray workers", unit="doc", disable=not index.show_progress)
    try:
        with _quiet_ray_data():
            share = (total if total is not None else 64 * workers) // (4 * workers)
            batch_size = options.documents_per_batch or min(16, max(1, share))
            if isinstance(rows, list):
                blocks = max(1, math.ceil(len(rows) / batch_size))  # a batch a block, spread over the workers
                rows = ray.data.from_items(rows, override_num_blocks=blocks)
            compressed = rows.map_batches(
                CompressWorker, batch_size=batch_size, batch_format="numpy",
                compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=options.cpus_per_worker,
                num_gpus=options.gpus_per_worker or None, fn_constructor_kwargs=worker_args,
                udf_modifying_row_count=False,
            )
            for batch in compressed.iter_batches(batch_size=None, batch_format="numpy"):
                results += [DocumentResult(*row) for row in zip(*(batch[name] for name in DocumentResult._fields))]
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
    return results, {"startup_seconds": round(first[0] - started, 3) if first else None,
                     "running_tokens_per_s": None if running is None else round(running, 1)}


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


def _rows(data: Any) -> tuple[list[dict[str, Any]] | ray.data.Dataset, dict[str, str]]:
    """The documents to send, one row each ({"position", "text", "id", "metadata"}), and the files skipped."""
    if isinstance(data, ray.data.Dataset):
        return data, {}
    items = [data] if isinstance(data, (str, Path)) else list(data)
    skipped: dict[str, str] = {}
    if all(isinstance(item, Document) for item in items):
        docs = items
    elif all(isinstance(item, (str, Path)) for item in items):
        docs, skipped = read_documents(items)
    else:
        raise TypeError("ingest_distributed takes file or folder paths, Documents, or a Ray Dataset; got "
                        f"{', '.join(sorted({type(item).__name__ for item in items}))}")
    return [{"position": i, "text": d.page_content, "id": d.id or "", "metadata": json.dumps(d.metadata)}
            for i, d in enumerate(docs)], skipped


def _default_workers(options: RayIngestOptions) -> int:
    resources = ray.cluster_resources()
    if options.gpus_per_worker:
        return max(1, int(resources.get("GPU", 0) // options.gpus_per_worker))
    return max(1, int(resources.get("CPU", 1) // options.cpus_per_worker))


def _gather(results: list[DocumentResult]) -> tuple[list[Document], list[np.ndarray]]:
    """The chunks and vectors of every document, in the documents' order (then their sources')."""
    chunks, vectors = [], []
    for result in sorted(results, key=lambda r: (int(r.position), str(r.source), str(r.chunks))):
        found = json.loads(result.chunks)
        if found:
            chunks += [Document(id=c["id"], page_content=c["page_content"], metadata=c["metadata"]) for c in found]
            vectors += list(np.frombuffer(result.vectors, dtype=np.float32).reshape(len(found), -1))
    return chunks, vectors


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
class DocumentResult(NamedTuple):
    """What a worker returns for one document (one output row): its chunks (JSON: id, page_content, metadata) and
    their float32 vectors, the states it compressed (the rest were in the store), tokens, and chunks already indexed."""

    position: int
    source: str
    chunks: str
    vectors: bytes
    computed: int
    tokens: int
    known: int


class CompressWorker:
    """A Ray Data actor: loads one model, then splits, compresses (into the shared store) and embeds documents."""

    def __init__(self, load_model: Callable[[], NuggetModel], settings: dict[str, Any], store: StoreLocation,
                 embeddings: Embeddings, chunk_tokens: int, chunk_overlap: int, fingerprint: str, known: list[str],
                 threads: int):
        torch.set_num_threads(threads)
        compressor = NuggetCompressor(model=load_model(), store=store.open(), **settings)
        if compressor.fingerprint != fingerprint:
            raise ModelMismatchError(
                f"this worker's nugget model ({compressor.model.base_name}, fingerprint {compressor.fingerprint}) "
                f"is not the driver's (fingerprint {fingerprint}); it was refused before writing anything. Load the "
                "driver's checkpoint, base model and dtype on every node (ModelLoader, or --checkpoint/--base-model)"
            )
        self.index = NuggetIndex(compressor, embeddings, chunk_tokens=chunk_tokens, chunk_overlap=chunk_overlap)
        self.known = frozenset(known)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One row a document: the batch's new chunks are compressed together (the compressor's batched passes)."""
        compressor = self.index.compressor
        docs = [_document(batch, i, str(text)) for i, text in enumerate(batch["text"])]
        split = [self.index.split([doc]) for doc in docs]
        new = [[c for c in chunks if c.id not in self.known] for chunks in split]
        texts = {c.page_content for chunks in new for c in chunks}
        missing = {text for text in texts if compressor.store.get(text, compressor.fingerprint) is None}
        done = compressor.invoke([c for chunks in new for c in chunks]) if texts else []
        vectors = np.asarray(self.index.embeddings.embed_documents([c.page_content for c in done]) if done else [],
                             dtype=np.float32)
        out: dict[str, list] = {name: [] for name in DocumentResult._fields}
        start = 0
        for i, (doc, chunks, fresh) in enumerate(zip(docs, split, new)):
            mine, start = done[start : start + len(fresh)], start + len(fresh)
            out["position"].append(int(batch["position"][i]) if "position" in batch else 0)
            out["source"].append(str(doc.metadata.get("source", "")))
            out["chunks"].append(json.dumps([{"id": c.id, "page_content": c.page_content, "metadata": c.metadata}
                                             for c in mine]))
            out["vectors"].append(vectors[start - len(fresh) : start].tobytes())
            out["computed"].append(len({c.page_content for c in fresh} & missing))
            missing -= {c.page_content for c in fresh}  # a text two documents share was compressed once
            out["tokens"].append(sum(c.metadata[METADATA_KEY]["n_tokens"] for c in mine))
            out["known"].append(len(chunks) - len(fresh))
        return {name: np.array(values, dtype=object) for name, values in out.items()}


def _document(batch: dict[str, np.ndarray], i: int, text: str) -> Document:
    """Row `i` of a batch as a Document: the driver's rows carry JSON metadata; a Dataset's rows "id", "title",
    "source" columns (as a JSONL line's fields)."""
    if "metadata" in batch:
        return Document(page_content=text, metadata=json.loads(batch["metadata"][i]), id=batch["id"][i] or None)
    meta = {k: str(batch[k][i]) for k in ("id", "title", "source") if k in batch and batch[k][i] is not None}
    if meta.get("id") or meta.get("source"):
        meta["source"] = meta.get("id") or meta["source"]
    return Document(page_content=text, metadata=meta)


__all__ = ["CompressWorker", "ModelLoader", "ModelMismatchError", "RayClusterError", "RayIngestOptions",
           "connect", "ingest_distributed", "shared_location"]

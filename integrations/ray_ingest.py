"""Ingest on a Ray cluster's public import path, as README shows it (`from nugget_rag.integrations.ray_ingest import
ingest_distributed`): the names of ingest/ray.py, which needs the [ray] extra, so the package's __init__ leaves it out.
"""

from .ingest.ray import (
    ChunkResult,
    CompressWorker,
    ModelLoader,
    ModelMismatchError,
    RayClusterError,
    RayCompression,
    RayIngestOptions,
    connect,
    ingest_distributed,
    read_input,
    shared_location,
)

__all__ = ["ChunkResult", "CompressWorker", "ModelLoader", "ModelMismatchError", "RayClusterError", "RayCompression",
           "RayIngestOptions", "connect", "ingest_distributed", "read_input", "shared_location"]

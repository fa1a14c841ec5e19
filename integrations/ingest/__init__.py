"""Ingest: loading documents (loaders.py), token-aware chunking (chunking.py), the one pipeline every entrance runs
(pipeline.py), and that pipeline on a Ray cluster (ray.py). Reads an index only through pipeline.IngestTarget."""

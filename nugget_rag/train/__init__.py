"""Training (see nugget_rag/train/__main__.py)."""

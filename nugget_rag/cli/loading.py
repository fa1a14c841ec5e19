"""What a command loads from its arguments: the nugget model (as a compressor), the retrieval embeddings, the user's
vector store, the model each Ray worker loads. Tests replace these (`monkeypatch.setattr(cli.loading, ...)`), so the
commands call them through this module."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from langchain_core.embeddings import Embeddings

from ..components.compressor import NuggetCompressor
from .options import UserError

if TYPE_CHECKING:
    from ..integrations.stores.spec import VectorStoreSpec
    from ..model.nugget_model import NuggetModel


def load_compressor(args: argparse.Namespace, store_dir: Path | None = None) -> NuggetCompressor:
    """The nugget model named by --checkpoint/--base-model/--device, with its nuggets in the Redis of --store (checked
    first), else a store in `store_dir`, else memory."""
    from ..integrations import load_compressor as load

    store = args.store.open() if getattr(args, "store", None) else None
    return load(args.checkpoint, base_model=args.base_model, store_dir=None if store else store_dir, store=store,
                device=args.device, ratio=getattr(args, "ratio", None), dtype=getattr(args, "dtype", None))


def ray_model_loader(args: argparse.Namespace) -> Callable[[], NuggetModel]:
    """What each Ray worker loads: the driver's --checkpoint and --base-model (in the driver model's dtype)."""
    from ..integrations.ingest.ray import ModelLoader

    return ModelLoader(checkpoint=args.checkpoint, base_model=args.base_model)


def set_decoder_weights(compressor: NuggetCompressor, args: argparse.Namespace) -> None:
    """--weights: how the decoder's passes run (int8: faster on a CPU)."""
    try:
        compressor.model.merged_format = args.weights
    except ValueError as err:
        raise UserError(f"--weights {args.weights}: {err}") from None


def load_embeddings(args: argparse.Namespace) -> Embeddings:
    """The retrieval embeddings: the bundled all-MiniLM-L6-v2."""
    from ..integrations import minilm_embeddings

    return minilm_embeddings(device=args.device)


def vectorstore_spec(args: argparse.Namespace) -> VectorStoreSpec | None:
    """--vectorstore and --vectorstore-kwargs: the user's vector store to build, or None (the index's own FAISS)."""
    from ..integrations.stores.spec import VectorStoreSpec

    if args.vectorstore is None:
        if args.vectorstore_kwargs:
            raise UserError("--vectorstore-kwargs are the settings of a --vectorstore MODULE:NAME; name the store")
        return None
    return VectorStoreSpec(target=args.vectorstore, kwargs=args.vectorstore_kwargs)


__all__ = ["load_compressor", "load_embeddings", "ray_model_loader", "set_decoder_weights", "vectorstore_spec"]

"""The index a command's arguments name, opened one way for every command: the index saved in --index DIR, or the
one published in the Redis of --store (integrations/published/index.py), read with the nuggets it was built with."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore

from ..cancellation import Stop
from ..components.compressor import NuggetCompressor
from . import loading
from .options import UserError

if TYPE_CHECKING:
    from ..integrations.local.index import NuggetIndex, Pipeline
    from ..integrations.published.index import PublishedIndex
    from ..integrations.stores.spec import VectorStoreSpec
    from ..state.store import StoreLocation


@dataclass(frozen=True)
class CommandIndex:
    """The index the arguments name and what reads it: the compressor (on the index's store, at its ratio), the
    embeddings, and the user's vector store where --vectorstore names one (its spec, and the store built from it).
    `directory` None: the index published in `store`."""

    directory: Path | None
    store: StoreLocation | None
    compressor: NuggetCompressor
    embeddings: Embeddings
    vectorstore_spec: VectorStoreSpec | None = None
    vectorstore: VectorStore | None = None

    def open(self) -> NuggetIndex:
        """The index saved in the directory, loaded (a new, empty one where none is saved yet)."""
        from ..integrations import NuggetIndex

        return NuggetIndex.open(self.directory, self.compressor, self.embeddings, vectorstore=self.vectorstore)

    def ingest(self, documents: Iterable[Document], stop: Stop | None = None, pipeline: Pipeline | None = None,
               **settings: Any) -> tuple[NuggetIndex, int]:
        """`documents` added to the index in the directory, under its lock, and saved (`ingest_into_directory`):
        the index as saved, and its new chunks. `settings` are NuggetIndex's (chunking, progress)."""
        from ..integrations.local.index import ingest_into_directory

        return ingest_into_directory(self.directory, self.compressor, self.embeddings, documents, stop, pipeline,
                                     vectorstore=self.vectorstore, **settings)

    def published(self, **settings: Any) -> PublishedIndex:
        """The index published in the store, its segments cached on this machine; `settings` are PublishedIndex's."""
        from ..integrations.published.index import PublishedIndex, cache_directory

        return PublishedIndex(self.compressor, self.embeddings, cache_dir=cache_directory(self.store), **settings)


def open_index(args: argparse.Namespace, must_exist: bool = False) -> CommandIndex:
    """The index --index DIR names, else the one published in --store (the command has checked one is given), with
    the model at the ratio its nuggets were made at. `must_exist`: refuse a directory no index is saved in.

    Refused, before the model loads: a --ratio other than the index's, --vectorstore with a published index (its
    vectors are in the store)."""
    from ..integrations.published.named import NamedIndex

    ratio = getattr(args, "ratio", None)
    if args.index is None and args.vectorstore is not None:
        raise UserError("--vectorstore: an index published in --store keeps its vectors in the store; a vector "
                        "store of your own is read with --index DIR, the directory it was ingested into")
    named = NamedIndex(args.index, args.store.open() if args.index is None else None)
    manifest = saved_manifest(args.index) if must_exist and args.index is not None else named.manifest()
    if manifest is not None and ratio is not None and ratio != manifest.get("ratio"):
        if args.index is None:
            raise UserError(f"the index published in {args.store} holds nuggets at r = {manifest.get('ratio'):g}; "
                            f"ingest into an --index directory to use r = {ratio:g}")
        raise UserError(f"the index in {args.index} holds nuggets at r = {manifest.get('ratio'):g}; "
                        f"ingest into a new --index directory to use r = {ratio}")
    args.ratio = ratio if manifest is None else manifest.get("ratio")  # the nuggets it was built with
    if args.index is None:
        return CommandIndex(None, args.store, reading_compressor(args), loading.load_embeddings(args))
    from ..integrations.local.files import NUGGETS_DIR

    compressor = reading_compressor(args, store_dir=args.index / NUGGETS_DIR)
    embeddings = loading.load_embeddings(args)
    spec = loading.vectorstore_spec(args)
    return CommandIndex(args.index, args.store, compressor, embeddings, spec,
                        None if spec is None else spec.build(embeddings))


def reading_compressor(args: argparse.Namespace, store_dir: Path | None = None) -> NuggetCompressor:
    """The model as the command's options set it: --text-states and --keep-ratio (what an ingest stores), --weights
    (how the decoder runs: ask and serve)."""
    compressor = loading.load_compressor(args, store_dir=store_dir)
    compressor.text_states = getattr(args, "text_states", False)
    if getattr(args, "keep_ratio", None) is not None:
        compressor = compressor.model_copy(update={"keep_ratio": args.keep_ratio})
    if hasattr(args, "weights"):
        loading.set_decoder_weights(compressor, args)
    return compressor


def saved_manifest(index_dir: Path) -> dict:
    """The manifest of the index saved in `index_dir`; refused where there is none."""
    from ..integrations import read_manifest

    manifest = read_manifest(index_dir)
    if manifest is None:
        raise UserError(f"no index in {index_dir}: run `nugget-rag ingest PATH... --index {index_dir}` first")
    return manifest


__all__ = ["CommandIndex", "open_index", "saved_manifest"]

"""`nugget-rag prune`: remove the nugget states in an index's store that no index over that store references."""

from __future__ import annotations

import argparse
from pathlib import Path

from .opening import saved_manifest
from .options import UserError, add_store_option, add_verbose_option


def register(commands: argparse._SubParsersAction, model_options: argparse.ArgumentParser) -> None:
    """The `prune` command (the model's options are not asked: it reads no model)."""
    prune = commands.add_parser("prune", help="remove stored nuggets no index references",
                                description="Remove the nugget states in the index's store that no index over "
                                            "that store references (after `delete`s, re-chunking, other models). "
                                            "Every index saved over a shared --store is read and kept; one "
                                            "another host holds makes prune refuse.")
    prune.add_argument("--index", type=Path, required=True, metavar="DIR", help="index directory")
    add_store_option(prune)
    add_verbose_option(prune)
    prune.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..integrations import prune
    from ..integrations.local.files import NUGGETS_DIR
    from ..state.store import NuggetStore

    saved = saved_manifest(args.index).get("nugget_store", "directory")
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

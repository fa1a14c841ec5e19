"""`nugget-rag index check`: check every version of the index published in a store, or repair it."""

from __future__ import annotations

import argparse

from .options import add_verbose_option, positive_float, redis_store


def register(commands: argparse._SubParsersAction, model_options: argparse.ArgumentParser) -> None:
    """The `index` command and its one action, `check` (the model's options are not asked: it reads no model)."""
    index = commands.add_parser("index", help="check or repair the index published in a store",
                                description="The index published in a --store (ingest/serve --store without "
                                            "--index): check every version, segment and count, or repair them.")
    check = index.add_subparsers(dest="action", required=True, metavar="ACTION").add_parser(
        "check", help="check every version the pointer names; --repair mends them",
        description="Check the published index: every version, segment (present, checksum), count, chunk id, and "
                    "the nugget states its chunks name; exit 1 while anything is broken. --repair writes a damaged "
                    "segment again from a verified copy (this machine's cache, another version), else publishes a "
                    "version without the lost chunks and lists their sources to ingest again.")
    check.add_argument("--store", type=redis_store, required=True, metavar="REDIS_URL",
                       help="the store the index is published in")
    check.add_argument("--name", default="default", help="the published index's name (default: default)")
    check.add_argument("--repair", action="store_true", help="mend what is broken (takes the publish lock)")
    check.add_argument("--wait", type=positive_float, default=60, metavar="SECONDS",
                       help="with --repair: how long to wait for another publisher's lock (default 60)")
    add_verbose_option(check)
    check.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`index check`: the index published in --store, every version checked (--repair: mended, or republished
    without what is lost); exit 1 while anything stays broken, or when chunks were lost."""
    from ..integrations.published.check import check_index, repair_index
    from ..integrations.published.index import cache_directory

    store = args.store.open()
    if args.repair:
        report = repair_index(store, args.name, [cache_directory(args.store, args.name)], args.wait)
    else:
        report = check_index(store, args.name)
    print(report.text())
    return 0 if report.ok and not report.lost_sources else 1

"""The `nugget-rag` command: ingest documents into an index, ask questions over it, inspect nuggets, train, evaluate.

    nugget-rag ingest docs/ notes.md corpus.jsonl --index my-index
    nugget-rag ingest corpus/ --index my-index --store redis://head:6379/0 --ray head:6379
    nugget-rag ask "How do I parse JSON?" --index my-index
    nugget-rag summarize report.txt --index my-index
    nugget-rag prune --index my-index
    nugget-rag jobs resume ingest-1f0e... --index my-index
    nugget-rag index check --store redis://head:6379/0 --repair
    nugget-rag inspect README.md --html nuggets.html
    nugget-rag train --config configs/recipe-r10.yaml
    nugget-rag eval --tasks squad --ratios 10 --limit 20

One module a command, each adding its own parser (`register`) and running it (`run`); the model's options come from
one parent parser (options.py), the index from `open_index` (opening.py), the model and embeddings from loading.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..state.redaction import redacted
from . import ask, harness, index, ingest, inspect, jobs, loading, prune, refloor, serve, summarize
from .loading import load_compressor, load_embeddings, vectorstore_spec  # as before; tests replace cli.loading's
from .options import UserError, model_options

log = logging.getLogger("nugget_rag.cli")
COMMANDS = [ingest, ask, summarize, serve, jobs, index, refloor, prune, inspect, harness]  # in `nugget-rag --help`'s order


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nugget-rag", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parent = model_options()
    for command in COMMANDS:
        command.register(commands, parent)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed by argparse
        return int(exit_.code or 0)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    level = logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose or args.command == "train" else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s" if args.command == "train"
                        else "%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError, OSError, ImportError) as err:
        log.debug("details", exc_info=True)
        print(f"nugget-rag {args.command}: error: {redacted(str(err))}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "load_compressor", "load_embeddings", "loading", "main", "vectorstore_spec"]

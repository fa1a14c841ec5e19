"""`nugget-rag refloor`: cut every stored state of an index to a coarser floor (integrations/local/refloor.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .opening import open_index
from .options import UserError, add_stores_options, ratio_arg


def register(commands: argparse._SubParsersAction, model_options: argparse.ArgumentParser) -> None:
    refloor = commands.add_parser("refloor", parents=[model_options], help="keep fewer nuggets of each indexed chunk",
                                  description="Cut every stored state of an index to a coarser floor: the store "
                                              "keeps only the nuggets of readings at r >= KEEP_RATIO (the default "
                                              "policy reads r >= 4). Stop servers on the index first.")
    refloor.add_argument("--index", type=Path, required=True, metavar="DIR", help="index directory")
    # dest new_floor: --keep-ratio is here the floor to cut to, not the compressor's (as ingest's is)
    refloor.add_argument("--keep-ratio", type=ratio_arg, required=True, metavar="R", dest="new_floor",
                         help="the new floor, coarser than the index's (e.g. 4, what the default policy reads)")
    refloor.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_stores_options(refloor)
    refloor.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..integrations import refloor

    index = open_index(args, must_exist=True)
    try:
        report = refloor(args.index, index.compressor, args.new_floor, index.embeddings, show_progress=not args.quiet,
                         vectorstore=index.vectorstore)
    except ValueError as err:
        raise UserError(str(err)) from None
    if report.new_floor == report.old_floor:
        print(f"{args.index} already keeps nuggets down to r = {report.old_floor:g}: nothing to do")
        return 0
    shrink = f" ({report.bytes_before / report.bytes_after:.2f}x smaller)" if report.bytes_after else ""
    print(f"Re-floored {report.refloored} of {report.chunks} chunks in {args.index} from r = {report.old_floor:g} to "
          f"r = {report.new_floor:g}: {report.bytes_before / 2**20:.1f} MiB -> {report.bytes_after / 2**20:.1f} MiB"
          f"{shrink}; {report.missing} not in the store are compressed when first read")
    return 0

"""`nugget-rag summarize`: summarise files of any length from their nuggets, streaming the summary.

With --index DIR the files are ingested into that index first (its one ingest path: chunks, vectors, nuggets in its
store), and the summary reads their chunks' stored nuggets: a second summary, or `nugget-rag ask` about them,
compresses nothing again. With --store alone the nuggets are kept in that Redis; with neither, in memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import get_args

from ..config import SummaryReading
from . import loading
from .opening import open_index
from .options import UserError, add_stores_options, positive_int, ratio_arg


def register(commands: argparse._SubParsersAction, model_options: argparse.ArgumentParser) -> None:
    summarize = commands.add_parser("summarize", parents=[model_options], help="summarise long files from their nuggets",
                                    description="Compress the files into nuggets (stored for reuse) and stream one "
                                                "summary of them.")
    summarize.add_argument("paths", nargs="+", type=Path, metavar="FILE", help="files or folders, read as one document")
    summarize.add_argument("--index", type=Path, metavar="DIR", help="ingest into this index and keep the nuggets in "
                           "its store (questions about the files then read them too)")
    summarize.add_argument("--ratio", type=ratio_arg, help="the ratio r the nuggets are read at (default 4: the floor "
                           "every stored state keeps)")
    summarize.add_argument("--reading", choices=get_args(SummaryReading),
                           help="outline: a sentence a section from its nuggets; sections: those sentences combined; "
                                "nuggets: every nugget read at once (default: the measured best, "
                                f"{get_args(SummaryReading)[0]})")
    summarize.add_argument("--max-new-tokens", type=positive_int, default=160, metavar="N",
                           help="summary length (default 160)")
    add_stores_options(summarize)
    summarize.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..integrations import load_documents
    from ..integrations.retrieval.summary_chain import NuggetSummarizer

    documents = [d for d in load_documents(args.paths) if d.page_content.strip()]
    if not documents:
        raise UserError(f"nothing to summarise in {', '.join(map(str, args.paths))}: no file with text was read")
    ratio, args.ratio = args.ratio, None  # the summary's reading, not the ratio the index answers questions at
    if args.index is not None:
        opened = open_index(args)
        index, added = opened.ingest(documents, show_progress=True)
        print(f"{args.index}: {added} new chunk(s) ingested, their nuggets stored", file=sys.stderr)
        sources = {d.metadata.get("source") for d in documents}
        parts = [d for d in index.documents if d.metadata.get("source") in sources]
        compressor = opened.compressor
    else:
        parts, compressor = documents, loading.load_compressor(args)
    compressor.show_progress = True
    chosen = {"reading": args.reading} if args.reading else {}
    if ratio is not None:
        chosen["ratio"] = ratio
    summarizer = NuggetSummarizer(compressor=compressor, max_new_tokens=args.max_new_tokens, **chosen)
    final = None
    for chunk in summarizer.stream(parts):
        sys.stdout.write(chunk.content)
        sys.stdout.flush()
        final = chunk if final is None else final + chunk
    meta = final.response_metadata
    print(f"\n\n{meta['n_document_tokens']:,} tokens in {meta['n_sections']} part(s) read as {meta['n_nuggets']:,} "
          f"nuggets (r = {meta['compression_ratio']:.1f}; {'all from the store' if meta['cached'] else 'compressed'}"
          f" in {meta['compress_seconds']:.1f} s), summarised in {meta['decode_seconds']:.1f} s", file=sys.stderr)
    return 0

"""`nugget-rag ask`: answer a question from an index (a directory, the one published in a store, or a running
`nugget-rag serve`), streaming the answer and naming its sources."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..components.resolution import RESOLUTIONS
from . import options
from .opening import open_index
from .options import API_KEY_ENV, UserError, positive_int


def register(commands: argparse._SubParsersAction, model_options: argparse.ArgumentParser) -> None:
    ask = commands.add_parser("ask", parents=[model_options], help="answer a question from an index",
                              description="Retrieve the closest chunks, read their nuggets and stream the answer.")
    ask.add_argument("question")
    ask.add_argument("--index", type=Path, metavar="DIR", help="index directory (default: the index published in "
                     "the Redis of --store)")
    ask.add_argument("--url", help="ask a running `nugget-rag serve` instead, e.g. http://127.0.0.1:8000")
    ask.add_argument("-k", type=positive_int, default=4,
                     help="chunks to retrieve (default 4); --resolution reads, skims or drops each")
    ask.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N", help="answer length (default 128)")
    ask.add_argument("--resolution", choices=RESOLUTIONS, default="default",
                     help=("how each chunk is read: default (the best measured policy), uniform (all as nuggets at "
                           "the index's ratio), or a policy of nugget_rag.resolution with its defaults"))
    options.add_repetition_options(ask)
    options.add_weights_option(ask)
    options.add_stores_options(ask)
    ask.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..integrations import answer_chain, source_label

    if args.url:
        return ask_server(args)
    if args.index is None and args.store is None:
        raise UserError("ask needs --index DIR (a local index), --store REDIS_URL (the index published there) or "
                        "--url URL (a running `nugget-rag serve`)")
    opened = open_index(args, must_exist=True)
    index = opened.published().current() if opened.directory is None else opened.open()
    if not len(index):
        raise UserError(f"the index in {args.index or args.store} is empty; ingest documents into it first")
    chain = answer_chain(index, args.k, args.resolution, max_new_tokens=args.max_new_tokens,
                         no_repeat_ngram_size=args.no_repeat_ngram, repetition_penalty=args.repetition_penalty)
    answer = None
    for chunk in chain.stream(args.question):
        if chunk.content:
            sys.stdout.write(chunk.content)
            sys.stdout.flush()
        answer = chunk if answer is None else answer + chunk
    print()
    meta = answer.response_metadata if answer is not None else {}
    readings = {reading["index"]: reading for reading in meta.get("resolution", [])}
    print("Sources:")
    for source in meta.get("sources", []):
        how = readings.pop(source["index"], {}).get("reason")
        print(f"  {source_label(source)}" + (f"  [{how}]" if how else ""))
    for index, reading in readings.items():  # the chunks a resolution policy dropped
        print(f"  chunk {index + 1}: {reading['reason']}")
    return 0


def ask_server(args: argparse.Namespace) -> int:
    """Ask a running `nugget-rag serve` and stream its answer."""
    import urllib.error
    import urllib.request

    from ..integrations import source_label

    body = json.dumps({"question": args.question, "k": args.k, "resolution": args.resolution,
                       "max_new_tokens": args.max_new_tokens, "no_repeat_ngram_size": args.no_repeat_ngram,
                       "repetition_penalty": args.repetition_penalty}).encode()
    headers = {"Content-Type": "application/json"}
    if key := os.environ.get(API_KEY_ENV):
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(args.url.rstrip("/") + "/ask", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            tail = {}
            for line in response:
                message = json.loads(line)
                if "text" in message:
                    sys.stdout.write(message["text"])
                    sys.stdout.flush()
                elif "error" in message:
                    raise UserError(f"\nthe server at {args.url} stopped the answer: {message['error']['message']}")
                else:
                    tail = message
    except urllib.error.HTTPError as err:
        raise UserError(f"the server at {args.url} answered {err.code}: {err.read().decode(errors='replace')}") from err
    except urllib.error.URLError as err:
        raise UserError(f"cannot reach a nugget-rag server at {args.url}: {err.reason}") from err
    print("\nSources:")
    for meta in tail.get("sources", []):
        print(f"  {source_label(meta)}")
    return 0

"""The `nugget-rag` command: ingest documents into an index, ask questions over it, inspect nuggets.

    nugget-rag ingest docs/ notes.md corpus.jsonl --index my-index
    nugget-rag ask "How do I parse JSON?" --index my-index
    nugget-rag inspect README.md --html nuggets.html
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from langchain_core.embeddings import Embeddings

from .checkpoint_files import DEFAULT_CHECKPOINT
from .compressor import NuggetCompressor
from .config import NuggetConfig
from .llm import NuggetLLM

log = logging.getLogger("nugget_rag.cli")


class UserError(Exception):
    """A mistake in the command line or its inputs: reported as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------- seams
def load_compressor(args: argparse.Namespace, store_dir: Path | None = None) -> NuggetCompressor:
    """The nugget model named by --checkpoint/--base-model/--device, with a store in `store_dir` (else memory)."""
    from .integrations import load_compressor as load

    return load(args.checkpoint, base_model=args.base_model, store_dir=store_dir, device=args.device,
                ratio=getattr(args, "ratio", None))


def load_embeddings(args: argparse.Namespace) -> Embeddings:
    """The retrieval embeddings: the bundled all-MiniLM-L6-v2."""
    from .integrations import minilm_embeddings

    return minilm_embeddings(device=args.device)


# ---------------------------------------------------------------------------------------------- commands
def cmd_ingest(args: argparse.Namespace) -> int:
    from .integrations import NuggetIndex, load_documents
    from .integrations.faiss_store import MANIFEST_FILE, NUGGETS_DIR

    docs = load_documents(args.paths)
    if not docs:
        raise UserError(f"no text found in {', '.join(args.paths)}")
    manifest = _manifest(args.index) if (args.index / MANIFEST_FILE).exists() else None
    if manifest is not None:
        if args.ratio is not None and args.ratio != manifest.get("ratio"):
            raise UserError(f"the index in {args.index} holds nuggets at r = {manifest.get('ratio')}; "
                            f"ingest into a new --index directory to use r = {args.ratio}")
        args.ratio = manifest.get("ratio")
    compressor = load_compressor(args, store_dir=args.index / NUGGETS_DIR)
    options = {"show_progress": not args.quiet}
    if args.chunk_tokens is not None:
        options["chunk_tokens"] = args.chunk_tokens
    if args.chunk_overlap is not None:
        options["chunk_overlap"] = args.chunk_overlap
    with NuggetIndex.updating(args.index, compressor, load_embeddings(args), **options) as index:
        added = index.ingest(docs)
    stats = index.last_ingest
    print(f"Ingested {stats['documents']} documents as {stats['chunks']} chunks ({added} new, "
          f"{stats['skipped']} already indexed) into {args.index}: {len(index)} chunks in all, "
          f"nuggets in {args.index / NUGGETS_DIR}")
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    from .integrations import NuggetIndex, build_qa_chain, source_label
    from .integrations.faiss_store import NUGGETS_DIR

    args.ratio = _manifest(args.index).get("ratio")  # read the nuggets the index was built with
    compressor = load_compressor(args, store_dir=args.index / NUGGETS_DIR)
    index = NuggetIndex.load(args.index, compressor, load_embeddings(args))
    if not len(index):
        raise UserError(f"the index in {args.index} is empty; ingest documents into it first")
    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=args.max_new_tokens)
    answer = None
    for chunk in build_qa_chain(index, llm, k=args.k).stream(args.question):
        if chunk.content:
            sys.stdout.write(chunk.content)
            sys.stdout.flush()
        answer = chunk if answer is None else answer + chunk
    print()
    print("Sources:")
    for meta in (answer.response_metadata.get("sources", []) if answer is not None else []):
        print(f"  {source_label(meta)}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .integrations import nugget_view, render_html, render_terminal

    path = Path(args.text)
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except OSError:  # a long literal text is no file name
        is_file = is_dir = False
    if is_dir:
        raise UserError(f"{path} is a folder; inspect one file of it")
    if is_file:
        try:
            text, title = path.read_text(encoding="utf-8"), f"nuggets of {path}"
        except UnicodeDecodeError as err:
            raise UserError(f"{path} is not UTF-8 text") from err
    elif not any(c.isspace() for c in args.text) and (path.suffix or "/" in args.text):
        raise UserError(f"no such file: {args.text} (to inspect this literal text, add a space or other words)")
    else:
        text, title = args.text, "nuggets of the given text"
    if not text.strip():
        raise UserError("nothing to inspect: the text is empty")
    view = nugget_view(load_compressor(args), text)
    if args.html is None:
        auto = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        color = args.color == "always" or (args.color == "auto" and auto)
        print(render_terminal(view, color=color))
    else:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(render_html(view, title=title), encoding="utf-8")
        print(view.summary())
        print(f"wrote {args.html}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .eval.cli import run_from_args

    argv = args.argv[1:] if args.argv and args.argv[0] == "eval" else args.argv
    return run_from_args(args, argv)


def _manifest(index_dir: Path) -> dict:
    from .integrations.faiss_store import MANIFEST_FILE, _read_json

    if not (index_dir / MANIFEST_FILE).exists():
        raise UserError(f"no index in {index_dir}: run `nugget-rag ingest PATH... --index {index_dir}` first")
    return _read_json(index_dir / MANIFEST_FILE)


# ---------------------------------------------------------------------------------------------- parser
def _ratio(value: str) -> float:
    try:
        return NuggetConfig(ratio=float(value)).ratio
    except ValueError as err:  # float() and NuggetConfig's own check
        raise argparse.ArgumentTypeError(f"the compression ratio must be >= 1 (a number such as 10), got {value!r}") from err


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return number


def checkpoint_arg(value: str) -> str | Path | None:
    """--checkpoint: a directory, 'default' (the shipped one) or 'none' (untrained)."""
    return {DEFAULT_CHECKPOINT: DEFAULT_CHECKPOINT, "none": None}.get(value, Path(value))


def add_checkpoint_option(parser: argparse.ArgumentParser) -> None:
    """The --checkpoint option shared by the CLI and the examples."""
    parser.add_argument("--checkpoint", type=checkpoint_arg, default=DEFAULT_CHECKPOINT,
                        help="nugget checkpoint directory; 'default' (the default): the one shipped for "
                             "SmolLM2-135M-Instruct (untrained on another base model); 'none': untrained adapters")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_checkpoint_option(common)
    common.add_argument("--base-model", type=Path, help="base LLaMA checkpoint directory (default: SmolLM2-135M)")
    common.add_argument("--device", help="torch device, e.g. cpu or cuda (default: cuda if available)")
    common.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv: debug)")

    parser = argparse.ArgumentParser(prog="nugget-rag", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ingest = commands.add_parser("ingest", parents=[common], help="index and compress documents",
                                 description="Split documents into chunks, index them in FAISS and compress their "
                                             "nuggets into the index directory (appending to an existing index).")
    ingest.add_argument("paths", nargs="+", metavar="PATH", help="text files, folders (recursively), JSONL files "
                                                                 "({\"text\", \"id\", \"title\", \"source\"} a line)")
    ingest.add_argument("--index", type=Path, required=True, metavar="DIR", help="index directory")
    ingest.add_argument("--ratio", type=_ratio, help="compression ratio r (default: the model's)")
    ingest.add_argument("--chunk-tokens", type=_positive, metavar="N", help="tokens per chunk (default 384)")
    ingest.add_argument("--chunk-overlap", type=int, metavar="N", help="tokens shared by neighbours (default 32)")
    ingest.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ingest.set_defaults(func=cmd_ingest)

    ask = commands.add_parser("ask", parents=[common], help="answer a question from an index",
                              description="Retrieve the closest chunks, read their nuggets and stream the answer.")
    ask.add_argument("question")
    ask.add_argument("--index", type=Path, required=True, metavar="DIR", help="index directory")
    ask.add_argument("-k", type=_positive, default=4, help="chunks to read (default 4)")
    ask.add_argument("--max-new-tokens", type=_positive, default=128, metavar="N", help="answer length (default 128)")
    ask.set_defaults(func=cmd_ask)

    inspect = commands.add_parser("inspect", parents=[common], help="show which tokens become nuggets",
                                  description="Highlight the tokens the Scorer keeps as nuggets (Dodo paper, Fig. 7).")
    inspect.add_argument("text", metavar="TEXT_OR_FILE", help="a file to read, or the text itself")
    inspect.add_argument("--ratio", type=_ratio, help="compression ratio r (default: the model's)")
    inspect.add_argument("--html", type=Path, metavar="OUT.html", help="write an HTML page instead of printing")
    inspect.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                         help="terminal highlighting (never: nuggets in [[brackets]])")
    inspect.set_defaults(func=cmd_inspect)

    from .eval.cli import add_arguments

    evaluate = commands.add_parser("eval", help="evaluate compression systems on the paper's tasks",
                                   description="Evaluation harness (issue 4): tasks x systems x ratios, speed and "
                                               "memory; writes JSON, a markdown table and plots.")
    add_arguments(evaluate)
    evaluate.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv: debug)")
    evaluate.set_defaults(func=cmd_eval)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed by argparse
        return int(exit_.code or 0)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    level = logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError, OSError, ImportError) as err:
        log.debug("details", exc_info=True)
        print(f"nugget-rag {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["UserError", "build_parser", "load_compressor", "load_embeddings", "main"]

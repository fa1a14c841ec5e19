"""`nugget-rag inspect`: show which tokens of a text the Scorer keeps as nuggets (Dodo paper, Fig. 7)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import loading
from .options import UserError, ratio_arg


def register(commands: argparse._SubParsersAction, model_options: argparse.ArgumentParser) -> None:
    inspect = commands.add_parser("inspect", parents=[model_options], help="show which tokens become nuggets",
                                  description="Highlight the tokens the Scorer keeps as nuggets (Dodo paper, Fig. 7).")
    inspect.add_argument("text", metavar="TEXT_OR_FILE", help="a file to read, or the text itself")
    inspect.add_argument("--ratio", type=ratio_arg, help="compression ratio r (default: the model's)")
    inspect.add_argument("--html", type=Path, metavar="OUT.html", help="write an HTML page instead of printing")
    inspect.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                         help="terminal highlighting (never: nuggets in [[brackets]])")
    inspect.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..integrations import nugget_view, render_html, render_terminal

    text, title = text_and_title(args.text)
    view = nugget_view(loading.load_compressor(args), text)
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


def text_and_title(given: str) -> tuple[str, str]:
    """The text to inspect (a file's, or `given` itself) and the page's title; refused: a folder, a file name with no
    file, text that is not UTF-8, nothing at all."""
    path = Path(given)
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
    elif not any(c.isspace() for c in given) and (path.suffix or "/" in given):
        raise UserError(f"no such file: {given} (to inspect this literal text, add a space or other words)")
    else:
        text, title = given, "nuggets of the given text"
    if not text.strip():
        raise UserError("nothing to inspect: the text is empty")
    return text, title

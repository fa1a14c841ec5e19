"""The options the `nugget-rag` commands share: the model's, as a parent parser, and the index's place and reading."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cli_options import add_checkpoint_option, add_store_option, add_vectorstore_option, add_verbose_option

API_KEY_ENV = "NUGGET_RAG_API_KEY"  # serve's --api-key, and what `ask --url` sends


def model_options() -> argparse.ArgumentParser:
    """The parent parser of the commands that load the nugget model: --checkpoint, --base-model, --device, -v."""
    parent = argparse.ArgumentParser(add_help=False)
    add_checkpoint_option(parent)
    parent.add_argument("--base-model", type=Path, help="base LLaMA checkpoint directory (default: SmolLM2-135M)")
    parent.add_argument("--device", help="torch device, e.g. cpu or cuda (default: cuda if available)")
    add_verbose_option(parent)
    return parent


def add_text_states_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text-states", action="store_true",
                        help="also store each chunk as the frozen model reads its text, so that no question waits "
                             "for the passage it reads whole (about twice the store's bytes)")


def add_stores_options(parser: argparse.ArgumentParser) -> None:
    """--store (the nuggets' Redis) and --vectorstore (the chunks' vectors), last among a command's options."""
    add_store_option(parser)
    add_vectorstore_option(parser)


__all__ = ["API_KEY_ENV", "add_stores_options", "add_text_states_option", "model_options"]

"""Options shared by every `nugget-rag` command (train's and eval's among them) and the examples, in one argument
style (--kebab-case FLAG VALUE): the model's, as a parent parser, the index's place and reading, the answer's. Below
the layers that read them: it imports no other module of the command."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from ..config import ANSWER_NO_REPEAT_NGRAM_SIZE, RAY_ADDRESS, MergedFormat, NuggetConfig
from ..model.checkpoint_files import DEFAULT_CHECKPOINT

if TYPE_CHECKING:
    from ..state.store import StoreLocation

API_KEY_ENV = "NUGGET_RAG_API_KEY"  # serve's --api-key, and what `ask --url` sends


class UserError(Exception):
    """A mistake in the command line or its inputs: reported as one line, exit code 2."""


def ratio_arg(value: str) -> float:
    """A compression ratio r >= 1."""
    try:
        return NuggetConfig(ratio=float(value)).ratio
    except ValueError as err:  # float() and NuggetConfig's own check
        raise argparse.ArgumentTypeError(f"the compression ratio must be >= 1 (a number such as 10), got {value!r}") from err


def bounded_number(value: str, kind: type[int] | type[float], ok: Callable[[float], bool], need: str) -> float:
    """`value` as an int or float for which `ok` holds; else an argparse error saying what it must be (`need`)."""
    try:
        number = kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {value!r}") from None
    if not ok(number):
        raise argparse.ArgumentTypeError(f"must be {need}, got {value}")
    return number


def positive_int(value: str) -> int:
    return bounded_number(value, int, lambda n: n >= 1, ">= 1")


def positive_float(value: str) -> float:
    return bounded_number(value, float, lambda n: n > 0, "> 0")


def checkpoint_arg(value: str) -> str | Path | None:
    """--checkpoint: a directory, 'default' (the shipped one) or 'none' (untrained)."""
    return {DEFAULT_CHECKPOINT: DEFAULT_CHECKPOINT, "none": None}.get(value, Path(value))


def add_checkpoint_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=checkpoint_arg, default=DEFAULT_CHECKPOINT,
                        help="nugget checkpoint directory; 'default' (the default): the one shipped for "
                             "SmolLM2-135M-Instruct (untrained on another base model); 'none': untrained adapters")


def ray_address(value: str) -> str:
    """--ray ADDRESS: 'local', 'auto', HOST:PORT or ray://HOST:PORT."""
    if value in ("local", "auto") or RAY_ADDRESS.fullmatch(value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not a Ray address ('auto', HOST:PORT or ray://HOST:PORT); write "
                                     "--ray after the PATHs, or as --ray=ADDRESS")


def replica_range(value: str) -> tuple[int, int | None]:
    """--replicas: N (fixed), or MIN..MAX (autoscaled); each >= 1."""
    low, dots, high = value.partition("..")
    try:
        bounds = (int(low), int(high) if dots else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not N or MIN..MAX (e.g. 2, or 1..4)") from None
    if min(b for b in bounds if b is not None) < 1:
        raise argparse.ArgumentTypeError(f"replicas must be >= 1, got {value}: a deployment needs one to answer")
    if bounds[1] is not None and bounds[1] < bounds[0]:
        raise argparse.ArgumentTypeError(f"{value}: MIN is above MAX")
    return bounds


def redis_store(value: str) -> StoreLocation:
    """--store: a Redis URL, parsed once into the location every command passes down."""
    from ..state.store import StoreLocation

    try:
        location = StoreLocation.parse(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not location.is_redis:
        raise argparse.ArgumentTypeError(f"--store takes a Redis URL (redis://HOST:PORT/DB), not the path {value!r}: "
                                         "an index keeps its nuggets in DIR/nuggets without --store")
    return location


def add_store_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", metavar="REDIS_URL", type=redis_store,
                        help="keep the nuggets in this Redis (redis://HOST:PORT/DB, ?namespace=PREFIX for a key "
                             "prefix other than nugget-rag; the [redis] extra), shared by every machine that reaches "
                             "it; default: DIR/nuggets")


def json_object(value: str) -> dict:
    """A JSON object, e.g. --vectorstore-kwargs '{"collection_name": "docs"}'."""
    try:
        found = json.loads(value)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err.msg} at character {err.pos}): {value!r}") from None
    if not isinstance(found, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object ({{\"name\": value, ...}}): {value!r}")
    return found


def add_vectorstore_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vectorstore", metavar="MODULE:NAME",
                        help="keep the chunks' vectors in this LangChain vector store: a VectorStore class, or a "
                             "function returning one, called with --vectorstore-kwargs and the embeddings (e.g. "
                             "langchain_chroma:Chroma, langchain_postgres:PGVector, or Qdrant's factory "
                             "langchain_qdrant:QdrantVectorStore.construct_instance with '{\"collection_name\": "
                             "\"docs\", \"client_options\": {\"path\": \"qdrant\"}}'); default: the index's own "
                             "FAISS. An index ingested into one is opened with it again (ask, serve, refloor)")
    parser.add_argument("--vectorstore-kwargs", type=json_object, default={}, metavar="JSON",
                        help="the vector store's settings, a JSON object (e.g. '{\"collection_name\": \"docs\"}')")


def _non_negative_int(value: str) -> int:
    return bounded_number(value, int, lambda n: n >= 0, ">= 0 (0: off)")


def _penalty(value: str) -> float:
    return bounded_number(value, float, lambda n: 1 <= n < float("inf"), "a finite number >= 1 (1: off)")


def add_repetition_options(parser: argparse.ArgumentParser) -> None:
    """The answer's settings against loops, with NuggetLLM's defaults."""
    parser.add_argument("--no-repeat-ngram", type=_non_negative_int, default=ANSWER_NO_REPEAT_NGRAM_SIZE, metavar="N",
                        help=f"no n-gram of N tokens twice in the answer (default {ANSWER_NO_REPEAT_NGRAM_SIZE}, which "
                             "keeps a small model from looping; 0: off)")
    parser.add_argument("--repetition-penalty", type=_penalty, default=1.0, metavar="P",
                        help="divide the positive logits of the tokens already generated by P (default 1: off)")


def add_verbose_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv: debug)")


def add_weights_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", choices=get_args(MergedFormat), default="float",
                        help="the decoder's weights: int8 decodes about 1.8x faster on a CPU (float32 models; "
                             "default float)")


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

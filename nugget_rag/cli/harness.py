"""`nugget-rag train` and `nugget-rag eval`: their options and runs are their packages' own (nugget_rag/train/cli.py,
nugget_rag/eval/cli.py); here they join the command."""

from __future__ import annotations

import argparse

from .options import add_verbose_option


def register(commands: argparse._SubParsersAction, model_options: argparse.ArgumentParser) -> None:
    """`train` and `eval`, which take their own model options (not the parent parser's)."""
    from ..eval import cli as eval_cli
    from ..train import cli as train_cli

    train = commands.add_parser("train", help="train the nugget adapters and Scorer", description=train_cli.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train_cli.add_arguments(train)
    add_verbose_option(train)
    train.set_defaults(func=train_cli.run_from_args)

    evaluate = commands.add_parser("eval", help="evaluate compression systems on the paper's tasks",
                                   description="Evaluation harness: tasks x systems x ratios, speed and memory; "
                                               "writes JSON, a markdown table and plots.")
    eval_cli.add_arguments(evaluate)
    add_verbose_option(evaluate)
    evaluate.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    """The harness's run, with the words after `eval` (recorded in its report as the command that made it)."""
    from ..eval.cli import run_from_args

    argv = args.argv[1:] if args.argv and args.argv[0] == "eval" else args.argv
    return run_from_args(args, argv)

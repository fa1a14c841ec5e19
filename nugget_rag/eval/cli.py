"""The options of `nugget-rag eval` (also `python -m nugget_rag.eval`), the evaluation harness.

    nugget-rag eval --tasks squad --systems full nodoc truncation nugget --ratios 10 --split dev --limit 20
    nugget-rag eval --tasks autoencoding squad cnndm lm hotpotqa speed --task-split hotpotqa=test \\
        --checkpoint runs/nugget --write-benchmarks BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

from ..cli.options import add_checkpoint_option, add_weights_option
from ..config import Decoding
from .config import TASKS, EvalConfig, all_systems


def _pair(value: str) -> tuple[str, str]:
    if "=" not in value:
        raise argparse.ArgumentTypeError(f"expected TASK=VALUE, got {value!r}")
    key, _, rest = value.partition("=")
    return key, rest


def _int(task: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"--task-limit {task}={value}: the limit must be a whole number") from None


def _ids_file(path: Path) -> list[str]:
    try:
        ids = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as err:
        raise ValueError(f"--only-ids {path}: cannot read it ({err.strerror})") from None
    if not ids:
        raise ValueError(f"--only-ids {path} lists no id: give a file with one example id a line")
    return ids


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from .systems import SYSTEMS

    parser.add_argument("--tasks", nargs="+", default=["squad"], metavar="TASK",
                        help=f"tasks: {', '.join((*TASKS, 'speed'))} (default: squad)")
    parser.add_argument("--systems", nargs="+", default=all_systems(), metavar="SYSTEM",
                        help=f"systems (default: all): {', '.join(sorted(SYSTEMS))}")
    parser.add_argument("--ratios", nargs="+", type=float, default=[5, 10, 20], metavar="R", help="ratios (default 5 10 20)")
    parser.add_argument("--split", choices=["train", "dev", "test", "all"], default="dev",
                        help="split of each file per splits.json (default dev; all: the whole file)")
    parser.add_argument("--task-split", type=_pair, action="append", default=[], metavar="TASK=SPLIT",
                        help="per-task split, e.g. hotpotqa=test (HotpotQA has only a test part)")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"), help="default data folder")
    parser.add_argument("--data", type=_pair, action="append", default=[], metavar="TASK=PATH",
                        help="a task's file (any file in the same format)")
    parser.add_argument("--limit", type=int, metavar="N", help="at most N examples per task (autoencoding: per length)")
    parser.add_argument("--task-limit", type=_pair, action="append", default=[], metavar="TASK=N",
                        help="a task's own limit, e.g. cnndm=30 (overrides --limit)")
    parser.add_argument("--sample", choices=["first", "random"], default="first",
                        help=("which examples a limit keeps in squad, hotpotqa and cnndm: the file's first (default) or "
                              "a seeded random sample of the split (SQuAD's first questions are one article's)"))
    parser.add_argument("--sample-seed", type=int, default=0, metavar="N", help="seed of --sample random (default 0)")
    add_checkpoint_option(parser)
    parser.add_argument("--full-checkpoint", type=Path, help="full-context fine-tuned decoder adapter checkpoint")
    parser.add_argument("--base-model", type=Path, help="base LLaMA directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    add_weights_option(parser)
    parser.add_argument("--decoding", choices=get_args(Decoding), default="dynamic",
                        help="how answers decode after the prompt: compiled records each step as a CUDA graph on "
                             "CUDA (static: the same cache, eager; default dynamic)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--ae-lengths", type=int, nargs="+", metavar="N", help="autoencoding lengths (default 100..500)")
    parser.add_argument("--lm-window", type=int, nargs=3, metavar=("HISTORY", "CONTEXT", "TARGET"),
                        help="LM tokens: compressed history, explicit context, scored target (default 640 64 64)")
    parser.add_argument("--long-articles", type=int, metavar="N",
                        help="long_cnndm: CNN/DM articles joined into one document (default 12)")
    parser.add_argument("--rag-passages", type=int, metavar="K",
                        help="squad_rag: passages per question, the gold one among retrieved ones (default 4)")
    parser.add_argument("--qa-prompt", metavar="TEMPLATE", help="QA instruction with {question} (default: the "
                        "paper's, App. D)")
    parser.add_argument("--keep-ratio", type=float, metavar="R", help="the store floor of the resolution systems' "
                        "compressor (default 4, as NuggetCompressor's; 1 keeps every position)")
    parser.add_argument("--qa-finish-sentence", type=int, metavar="N", help="QA: up to N tokens past the limit to end "
                        "the sentence it cut (default 0: the paper's hard limit of 64)")
    parser.add_argument("--qa-no-repeat-ngram", type=int, metavar="N", help="QA: never generate an n-gram of N "
                        "tokens twice in an answer (default 0: off, as in the paper)")
    parser.add_argument("--qa-repetition-penalty", type=float, metavar="P", help="QA: divide the positive logits of "
                        "the tokens already generated by P (default 1: off, as in the paper)")
    parser.add_argument("--only-ids", type=Path, metavar="FILE", help="of the examples the run would evaluate, only "
                        "those whose ids FILE lists, one a line: reruns some answers of a larger run")
    parser.add_argument("--speed-docs", type=int, nargs="+", metavar="N", help="documents per question (default 1 4 16)")
    parser.add_argument("--speed-repeats", type=int, help="timed repeats (default 3)")
    parser.add_argument("--speed-doc-tokens", type=int, metavar="N", help="tokens per document (default 512)")
    parser.add_argument("--speed-decode-steps", type=int, metavar="N", help="tokens generated to time decoding "
                        "(default 16)")
    parser.add_argument("--speed-no-policy", action="store_true", help="leave out the default resolution policy's "
                        "rows (Full and nuggets only)")
    parser.add_argument("--optimal", action="store_true", help="also run the Scorer's greedy-optimal study (App. A)")
    parser.add_argument("--optimal-examples", type=int, default=4, metavar="N", help="examples of that study (default 4)")
    parser.add_argument("--out-dir", type=Path, help="folder of the result files (default: a new temporary folder)")
    parser.add_argument("--name", default="eval", help="stem of the result files (default eval)")
    parser.add_argument("--write-benchmarks", type=Path, metavar="MD", help="update this file's harness section")
    parser.add_argument("--resume", action="store_true",
                        help=("keep the cells already in OUT_DIR/NAME.json that were run with the same task setup and "
                              "compute only the missing ones (runs of other tasks or ratios are merged into one report)"))
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return parser


def config_from_args(args: argparse.Namespace, argv: Sequence[str] | None = None) -> EvalConfig:
    if args.out_dir is None and args.resume:
        raise ValueError("--resume continues the run in --out-dir DIR: name that folder")
    values = {
        "tasks": args.tasks, "systems": args.systems, "ratios": args.ratios,
        "split": None if args.split == "all" else args.split,
        "task_splits": {k: (None if v == "all" else v) for k, v in args.task_split},
        "data_dir": args.data_dir, "data": {k: Path(v) for k, v in args.data}, "limit": args.limit,
        "task_limits": {k: _int(k, v) for k, v in args.task_limit},
        "sample": args.sample, "sample_seed": args.sample_seed,
        "checkpoint": args.checkpoint, "full_checkpoint": args.full_checkpoint, "base_model": args.base_model,
        "device": args.device, "dtype": args.dtype, "weights": args.weights, "decoding": args.decoding, "threads": args.threads, "batch_size": args.batch_size,
        "optimal": args.optimal, "optimal_examples": args.optimal_examples, "out_dir": args.out_dir, "name": args.name, "plots": not args.no_plots,
        "progress": not args.quiet, "write_benchmarks": args.write_benchmarks,
        "resume": args.resume,
        "command": "nugget-rag eval " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
    }
    given = {  # the options left out keep EvalConfig's defaults; one given out of range is refused by it
        "ae_lengths": args.ae_lengths, "long_articles": args.long_articles, "rag_passages": args.rag_passages,
        "qa_prompt": args.qa_prompt, "keep_ratio": args.keep_ratio, "qa_finish_sentence": args.qa_finish_sentence,
        "qa_no_repeat_ngram_size": args.qa_no_repeat_ngram, "qa_repetition_penalty": args.qa_repetition_penalty,
        "only_ids": None if args.only_ids is None else _ids_file(args.only_ids),
        "lm": None if args.lm_window is None else dict(zip(("history", "context", "target"), args.lm_window)),
    }
    values.update({name: value for name, value in given.items() if value is not None})
    speed = {"documents": args.speed_docs, "repeats": args.speed_repeats, "doc_tokens": args.speed_doc_tokens,
             "decode_steps": args.speed_decode_steps, "policy": False if args.speed_no_policy else None}
    speed = {name: value for name, value in speed.items() if value is not None}
    if speed:
        values["speed"] = speed
    cfg = EvalConfig(**values)
    if cfg.out_dir is None:  # checked first, so a refused configuration leaves no folder behind
        cfg = cfg.model_copy(update={"out_dir": Path(tempfile.mkdtemp(prefix="nugget-rag-eval-"))})
    return cfg


def run_from_args(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    from .runner import run

    cfg = config_from_args(args, argv)
    results = run(cfg)
    print((Path(results["files"]["markdown"])).read_text())
    print(f"wrote {results['files']['json']}, {results['files']['markdown']}"
          + (f" and {len(results['files']['plots'])} plots" if results["files"]["plots"] else ""))
    return 0

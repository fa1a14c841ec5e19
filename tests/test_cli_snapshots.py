"""`nugget-rag --help`, every command's `--help`, and one bad value a command, against the text the command gave
before it became a package of commands (tests/data/cli_help.json, tests/data/cli_errors.json).

The snapshots were taken from the single-module cli.py; `python tests/test_cli_snapshots.py` writes them again from
the code as it stands (only when a change of the text is meant). They hold on Python 3.11 to 3.13: both sides are
compared as 3.13's argparse writes an option's aliases (`normalised`), its one difference from 3.11's and 3.12's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest

from nugget_rag import cli

DATA = Path(__file__).parent / "data"
HELP_FILE, ERRORS_FILE = DATA / "cli_help.json", DATA / "cli_errors.json"
COLUMNS = "100"  # argparse wraps help to the terminal's width: one width for every run

HELP = [[], ["ingest"], ["ask"], ["summarize"], ["serve"], ["jobs"], ["index"], ["index", "check"], ["refloor"], ["prune"],
        ["inspect"], ["train"], ["eval"]]

BAD = {  # a case a command (or argparse before it) refuses: its arguments; none loads a model
    "no command": [],
    "unknown command": ["index-all"],
    "ingest: --chunk-tokens 0": ["ingest", "notes.md", "--chunk-tokens", "0"],
    "ingest: --workers without --ray": ["ingest", "/nonexistent/notes.md", "--workers", "2"],
    "ingest: a missing file": ["ingest", "/nonexistent/notes.md", "--index", "/nonexistent/index"],
    "ask: no index": ["ask", "Which planet?"],
    "ask: --repetition-penalty 0.5": ["ask", "Which planet?", "--repetition-penalty", "0.5"],
    "ask: --vectorstore with --store": ["ask", "Which planet?", "--store", "redis://127.0.0.1:1/0",
                                        "--vectorstore", "langchain_chroma:Chroma"],
    "summarize: a missing file": ["summarize", "/nonexistent/report.txt"],
    "summarize: --ratio 0.5": ["summarize", "report.txt", "--ratio", "0.5"],
    "serve: no index": ["serve"],
    "serve: --replicas without --ray": ["serve", "--index", "/nonexistent/index", "--replicas", "2"],
    "serve: --replicas 3..1": ["serve", "--replicas", "3..1"],
    "jobs: resume without an ID": ["jobs", "resume", "--index", "/nonexistent/index"],
    "jobs: no index": ["jobs", "list"],
    "jobs: no store in the index": ["jobs", "list", "--index", "/nonexistent/index"],
    "index: --store a path": ["index", "check", "--store", "/var/nuggets"],
    "refloor: no index": ["refloor", "--index", "/nonexistent/index", "--keep-ratio", "4"],
    "refloor: --keep-ratio 0.5": ["refloor", "--index", "/nonexistent/index", "--keep-ratio", "0.5"],
    "prune: no index": ["prune", "--index", "/nonexistent/index"],
    "inspect: a missing file": ["inspect", "missing_script.py"],
    "inspect: --ratio 0.5": ["inspect", "some text", "--ratio", "0.5"],
    "train: a missing config": ["train", "--config", "/nonexistent/run.yaml"],
    "eval: --task-split without =": ["eval", "--task-split", "hotpotqa"],
}


def normalised(text: str) -> str:
    """`text` with each option's aliases as Python 3.13's argparse writes them (`--nugget.ratio, --ratio V`), not as
    3.11's and 3.12's do (`--nugget.ratio V, --ratio V`), its help where it was."""
    lines = []
    for line in text.split("\n"):
        body = line.lstrip(" ")
        invocation = body.partition("  ")[0]
        parts = [part.split(" ") for part in invocation.split(", ")]
        if body.startswith("-") and len(parts) > 1 and all(len(p) == 2 for p in parts) and \
                len({p[1] for p in parts}) == 1:
            aliases = ", ".join(p[0] for p in parts) + " " + parts[0][1]
            rest = body[len(invocation):]
            line = line[:len(line) - len(body)] + aliases + (" " * (len(invocation) - len(aliases)) + rest if rest
                                                             else "")
        lines.append(line)
    return "\n".join(lines)


def comparable(outcome: dict) -> dict:
    return {key: normalised(value) if isinstance(value, str) else value for key, value in outcome.items()}


def run(argv: list[str]) -> dict:
    """The exit code and the text `nugget-rag ARGV` writes."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def helps() -> dict[str, dict]:
    return {" ".join(["nugget-rag", *command, "--help"]): run([*command, "--help"]) for command in HELP}


def errors() -> dict[str, dict]:
    return {name: {"argv": argv, **run(argv)} for name, argv in BAD.items()}


@pytest.fixture(autouse=True)
def fixed_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", COLUMNS)


@pytest.mark.parametrize("snapshot, capture", [(HELP_FILE, helps), (ERRORS_FILE, errors)], ids=["help", "errors"])
def test_the_command_says_what_it_said_before_the_move(snapshot, capture):
    """Each --help byte for byte; each bad value refused with the same exit code, usage and message."""
    expected = json.loads(snapshot.read_text())
    found = capture()
    assert list(found) == list(expected)
    for case, outcome in expected.items():
        assert comparable(found[case]) == comparable(outcome), case


def test_every_default_shown_is_a_value():
    """A default made by a factory (a data source's `readings`) is shown as its value, never as PydanticUndefined."""
    text = run(["train", "--help"])["stdout"]
    assert "PydanticUndefined" not in text and 'readings [{"passages":4,' in text


def test_options_with_aliases_compare_as_python_3_13_writes_them():
    """What 3.11 and 3.12 print (the snapshots) and what 3.13 prints compare equal, and nothing else changes."""
    before = "  --nugget.ratio V, --ratio V\n  --optim.lr V, --lr V  [0.0001]\n  --n N, -x M  mixed\n  -h, --help"
    after = "  --nugget.ratio, --ratio V\n  --optim.lr, --lr V    [0.0001]\n  --n N, -x M  mixed\n  -h, --help"
    assert normalised(before) == normalised(after) == after


def test_each_bad_value_is_refused_with_a_message():
    for case, outcome in json.loads(ERRORS_FILE.read_text()).items():
        assert outcome["code"] == 2 and "error: " in outcome["stderr"], case


if __name__ == "__main__":  # write the snapshots from the code as it stands
    os.environ["COLUMNS"] = COLUMNS
    DATA.mkdir(exist_ok=True)
    for path, found in ((HELP_FILE, helps()), (ERRORS_FILE, errors())):
        path.write_text(json.dumps(found, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {path} ({len(found)} cases)", file=sys.stderr)

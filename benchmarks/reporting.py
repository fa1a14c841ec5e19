"""What every benchmark report records and how it is written: where it goes (`add_out_option`, `add_name_options`),
the run's machine and load (`run_meta`, `made_by`), its Markdown tables (`table`), then OUT.json and OUT.md
(`write_report`)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"  # where a report goes by default


def add_out_option(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """--out OUT: the report's OUT.json and OUT.md; `default`: its name under benchmarks/results, else (None) the
    report is only printed unless --out is given."""
    if default is None:
        parser.add_argument("--out", type=Path, help="also write OUT.md and OUT.json")
    else:
        parser.add_argument("--out", type=Path, default=RESULTS / default,
                            help=f"write OUT.json and OUT.md (default: benchmarks/results/{default})")


def add_name_options(parser: argparse.ArgumentParser, name: str) -> None:
    """--name and --out-dir: the report's OUT_DIR/NAME.json and .md (default: benchmarks/results/`name`)."""
    parser.add_argument("--name", default=name)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)


def run_meta(**extra: Any) -> dict[str, Any]:
    """The command, machine, start time and load average of this run, then `extra` (a `command` there replaces
    sys.argv's)."""
    return {"command": " ".join(sys.argv), "cpus": os.cpu_count(),
            "machine": f"{platform.machine()}, {platform.processor() or platform.system()}",
            "started": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "load_before": round(os.getloadavg()[0], 2), **extra}


def device_name() -> str:
    """The GPU torch runs on, else the CPU."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()


def made_by(meta: dict[str, Any], *details: str) -> list[str]:
    """The Markdown lines saying how a report was made: its command, then its start, machine and `details`."""
    return [f"Command: `{meta['command']}`  ",
            "; ".join([f"Date: {meta['started']}", f"machine: {meta['machine']}, {meta['cpus']} CPUs", *details]) + "."]


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table's lines: the header, its rule, then a line a row, each cell as str() writes it."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def write_report(out: Path | None, report: dict[str, Any], text: str | Callable[[dict[str, Any]], str]) -> None:
    """Print the Markdown `text` (or what `text` renders from the finished report: its meta's load average after the
    run added); with `out`, also write `report` as OUT.json and the text as OUT.md (`out` with either suffix or none).
    """
    if "meta" in report:
        report["meta"]["load_after"] = round(os.getloadavg()[0], 2)
    text = text if isinstance(text, str) else text(report)
    print(text)
    if out is None:
        return
    stem = out.with_suffix("") if out.suffix in (".json", ".md") else out
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_name(stem.name + ".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    stem.with_name(stem.name + ".md").write_text(text)

"""What every benchmark report records and how it is written: the run's machine and load, then OUT.json and OUT.md."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def run_meta(**extra: Any) -> dict[str, Any]:
    """The command, machine, start time and load average of this run, then `extra`."""
    return {"command": " ".join(sys.argv), "cpus": os.cpu_count(),
            "machine": f"{platform.machine()}, {platform.processor() or platform.system()}",
            "started": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "load_before": round(os.getloadavg()[0], 2), **extra}


def write_report(out: Path, report: dict[str, Any], table: str) -> None:
    """`report` as OUT.json and `table` as OUT.md (the load average after the run added to its meta), and print
    the table."""
    if "meta" in report:
        report["meta"]["load_after"] = round(os.getloadavg()[0], 2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table)

"""Evaluation harness (issue 4): tasks, compared systems, speed/memory, and reports.

    nugget-rag eval --tasks squad --ratios 10 --limit 20          # or: python -m nugget_rag.eval ...

In Python: `run(EvalConfig(...), model=...)` evaluates an already loaded NuggetModel (the tests use a tiny one).
"""

from .config import EvalConfig
from .systems import SYSTEMS, Env, Query, Reading, Skipped, System, get_system, register


def run(cfg: EvalConfig, **kwargs):
    from .runner import run as _run

    return _run(cfg, **kwargs)


__all__ = ["SYSTEMS", "Env", "EvalConfig", "Query", "Reading", "Skipped", "System", "get_system", "register", "run"]

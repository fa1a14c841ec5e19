"""Compared systems, registered by name (as kvpress registers its presses). One file per system."""

from . import (  # noqa: F401  (importing registers)
    compressive,
    full,
    llmlingua_style,
    lmsumm,
    nugget,
    observed_attention,
    peers,
    snapkv,
    truncation,
)
from .base import SYSTEMS, Env, Query, Reading, Skipped, System, get_system, prompt_ids, register

__all__ = ["SYSTEMS", "Env", "Query", "Reading", "Skipped", "System", "get_system", "prompt_ids", "register"]

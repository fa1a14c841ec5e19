"""Compared systems, registered by name (as kvpress registers its presses). One file per system.

Importing a module registers its systems; this order is the order of the harness's tables and of "all systems".
"""
# isort: skip_file

from . import full, truncation, streaming_llm, compressive, observed_attention, kvzip, snapkv, llmlingua_style, lmsumm  # noqa: F401
from . import nugget, autoregressive, resolution  # noqa: F401
from . import peers  # noqa: F401
from .base import SYSTEMS, Env, Query, Reading, Skipped, System, get_system, prompt_ids, register

__all__ = ["SYSTEMS", "Env", "Query", "Reading", "Skipped", "System", "get_system", "prompt_ids", "register",
           "registered_systems"]


def registered_systems() -> list[str]:
    """Every registered system that runs by default (variants such as nugget_int8 run when named), in table order."""
    return [name for name, system in SYSTEMS.items() if system.in_default]

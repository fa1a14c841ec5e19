"""The reading plan's public import path: `from nugget_rag.resolution import QueryLikelihood, ...` (the policies are
components/resolution.py's)."""

from .components.resolution import (
    DEFAULT_EXPAND_MARGIN,
    POLICIES,
    PROBE_INSTRUCTION,
    RESOLUTIONS,
    DocumentReading,
    LexicalRerank,
    PlanCompressor,
    PlannedReading,
    QueryLikelihood,
    ResolutionPolicy,
    RetrieverRank,
    UniformResolution,
    default_resolution,
    resolve_policy,
)

__all__ = [
    "DEFAULT_EXPAND_MARGIN", "POLICIES", "PROBE_INSTRUCTION", "RESOLUTIONS", "DocumentReading", "LexicalRerank",
    "PlanCompressor", "PlannedReading", "QueryLikelihood", "ResolutionPolicy", "RetrieverRank", "UniformResolution",
    "default_resolution", "resolve_policy",
]

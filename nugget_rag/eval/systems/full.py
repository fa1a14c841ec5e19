"""Full (the whole document in the prompt), zero-shot and fine-tuned, and NoDoc (no document): the references."""

from __future__ import annotations

from ...config import DECODER
from .base import Env, Reading, System, register


@register("full")
class Full(System):
    label = "Full (zero-shot)"
    uses_ratio = False
    description = "The frozen model with the documents' text in the prompt (paper App. D)."

    def reader(self, env: Env) -> dict:
        """Who reads the text: the frozen model (no adapter)."""
        return {}

    def prepare(self, env: Env, queries, ratio):
        return [Reading(texts=list(q.documents), text_ids=list(q.document_ids), **self.reader(env)) for q in queries]


@register("full_ft")
class FullFineTuned(Full):
    label = "Full (fine-tuned)"
    description = "The documents' text in the prompt, read with a full-context fine-tuned decoder adapter."

    def available(self, env: Env) -> str | None:
        return None if env.full_model is not None else "no full-context fine-tuned adapter (--full-checkpoint)"

    def reader(self, env: Env) -> dict:
        return {"adapter": DECODER, "model": env.full_model}


@register("nodoc")
class NoDoc(System):
    label = "NoDoc"
    uses_ratio = False
    description = "The instruction alone (language modelling: the explicit context alone)."

    def prepare(self, env: Env, queries, ratio):
        return [Reading(texts=[], text_ids=[]) for _ in queries]

"""LMSumm (paper Sec. 6 and App. D.1): the model's own summary of each document, to ceil(words / r) words.

The frozen model is asked, in its chat template, "Please summarize the following text into $WORDS words:
$TEXT" with $WORDS = ceil(w / r) for a document of w words (counted by spaces); greedy, at most 2 * $WORDS + 16
new tokens. The summary replaces the document in Full's prompt. Summaries are not cut to the budget: the
report gives the compression actually reached (the paper's LM used 10.9 % of the length at r = 10).
"""

from __future__ import annotations

import math

from ...generation import GenerationSettings, generate
from ...prompts import LMSUMM_PROMPT, chat_token_ids
from .base import Env, Reading, Skipped, System, register


def summary_words(text: str, ratio: float) -> int:
    return max(1, math.ceil(len(text.split()) / ratio))


@register("lmsumm")
class LMSumm(System):
    label = "LMSumm (own summary to n/r words)"
    description = __doc__.split("\n\n")[1].replace("\n", " ")

    def prepare(self, env: Env, queries, ratio):
        model = env.model
        cache = env.cache_for(f"{self.name}@{ratio}")
        todo = sorted({d for q in queries for d in q.documents if d.strip() and d not in cache}, key=len)
        for start in range(0, len(todo), env.batch_size):
            chunk = todo[start : start + env.batch_size]
            words = [summary_words(d, ratio) for d in chunk]
            prompts = [chat_token_ids(model.tokenizer, [{"role": "user", "content": LMSUMM_PROMPT.format(words=w, text=d)}])
                       for d, w in zip(chunk, words)]
            rooms = [model.max_positions - len(p) - 1 for p in prompts]
            fits = [(d, p, min(room, 2 * w + 16)) for d, p, w, room in zip(chunk, prompts, words, rooms) if room >= 1]
            for d in set(chunk) - {d for d, _, _ in fits}:
                cache[d] = None
            if not fits:
                continue
            settings = GenerationSettings(max_new_tokens=max(b for _, _, b in fits), temperature=0)
            summaries = generate(model, [[] for _ in fits], [p for _, p, _ in fits], settings, adapter=None)
            for (d, _, budget), summary in zip(fits, summaries):  # each row's own budget, whatever its batch
                ids = model.tokenizer(summary, add_special_tokens=False)["input_ids"][:budget]
                cache[d] = model.tokenizer.decode(ids).strip()
        out = []
        for q in queries:
            if any(not d.strip() for d in q.documents):
                out.append(Skipped("empty document"))
            elif any(cache[d] is None for d in q.documents):
                out.append(Skipped("summarisation prompt exceeds the model's positions"))
            else:
                summaries = [cache[d] for d in q.documents]
                empty = sum(1 for s in summaries if not s)
                out.append(Reading(texts=summaries, info={"empty_summaries": empty} if empty else {}))
        return out

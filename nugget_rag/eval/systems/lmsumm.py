"""LMSumm (paper Sec. 6 and App. D.1): the model's own summary of each document, to ceil(words / r) words.

The frozen model is asked, in its chat template, "Please summarize the following text into $WORDS words:
$TEXT" with $WORDS = ceil(w / r) for a document of w words (counted by spaces); greedy, at most 2 * $WORDS + 16
new tokens. The summary replaces the document in Full's prompt. Summaries are not cut to the budget: the
report gives the compression actually reached (the paper's LM used 10.9 % of the length at r = 10). A document
longer than CHUNK_TOKENS (at most half the model's positions) is summarised in chunks of that many tokens whose
summaries are read one after another: map-reduce summarisation, the plain model's way through a text longer than
its positions.
"""

from __future__ import annotations

import math

from ...generation.decoding import GenerationSettings, generate
from ...prompts import LMSUMM_PROMPT, chat_token_ids
from .base import Env, Reading, Skipped, System, register

CHUNK_TOKENS = 2048


def summary_words(text: str, ratio: float) -> int:
    return max(1, math.ceil(len(text.split()) / ratio))


@register("lmsumm")
class LMSumm(System):
    label = "LMSumm / map-reduce (own summary to n/r words)"
    description = __doc__.split("\n\n")[1].replace("\n", " ")

    def prepare(self, env: Env, queries, ratio):
        model = env.model
        cache = env.cache_for(f"{self.name}@{ratio}")
        chunks = {q_doc: self._chunks(model, q_doc) for q in queries for q_doc in q.documents if q_doc.strip()}
        todo = sorted({c for pieces in chunks.values() for c in pieces if c not in cache}, key=len)
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
            elif any(cache[c] is None for d in q.documents for c in chunks[d]):
                out.append(Skipped("summarisation prompt exceeds the model's positions"))
            else:
                summaries = [" ".join(cache[c] for c in chunks[d]) for d in q.documents]
                empty = sum(1 for s in summaries if not s)
                info = {"empty_summaries": empty} if empty else {}
                if any(len(chunks[d]) > 1 for d in q.documents):
                    info["chunks"] = sum(len(chunks[d]) for d in q.documents)
                out.append(Reading(texts=summaries, info=info))
        return out

    @staticmethod
    def _chunks(model, text: str) -> list[str]:
        """The text, or its pieces of CHUNK_TOKENS tokens (at most half the positions) when it is longer (map)."""
        ids, size = model.tokenizer(text, add_special_tokens=False)["input_ids"], min(CHUNK_TOKENS, model.max_positions // 2)
        if len(ids) <= size:
            return [text]
        return [model.tokenizer.decode(ids[i : i + size]) for i in range(0, len(ids), size)]

"""RAG tasks: each question's passages as a retriever gives them, the gold ones among related distractors.

squad_rag: a SQuAD question with its gold paragraph and the k - 1 paragraphs of the same article that
all-MiniLM-L6-v2 ranks closest to the question, all k in the retriever's order (most similar first).
hotpotqa_rag: a HotpotQA question's 10 paragraphs (2 hold the supporting facts) in the retriever's order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


def retrieved(records: Iterable[dict], passages: int | None) -> Iterator[dict]:
    """The records with `documents` in retriever order and `gold` (their indices among them): with `passages`, SQuAD
    records (`article`, `paragraph`, `context`) get their article's closest paragraphs; without, each record's own
    `documents` (and `gold`) are reordered. Embeds lazily: a limited run embeds only what it reads."""
    from ..integrations import minilm_embeddings

    records = list(records)
    embed = minilm_embeddings()
    articles: dict[object, dict[int, str]] = {}
    for rec in records if passages else []:
        articles.setdefault(rec["article"], {})[rec["paragraph"]] = rec["context"]
    vectors: dict[object, np.ndarray] = {}
    for rec in records:
        question = np.asarray(embed.embed_query(rec["question"]))
        if passages:
            texts = articles[rec["article"]]
            if rec["article"] not in vectors:
                vectors[rec["article"]] = np.asarray(embed.embed_documents(list(texts.values())))
            similarity = dict(zip(texts, vectors[rec["article"]] @ question))
            others = sorted((p for p in texts if p != rec["paragraph"]), key=lambda p: -similarity[p])
            chosen = sorted([rec["paragraph"], *others[: passages - 1]], key=lambda p: -similarity[p])
            yield {**rec, "documents": [texts[p] for p in chosen], "gold": [chosen.index(rec["paragraph"])]}
        else:
            similarity = np.asarray(embed.embed_documents(rec["documents"])) @ question
            order = sorted(range(len(rec["documents"])), key=lambda i: -similarity[i])
            yield {**rec, "documents": [rec["documents"][i] for i in order],
                   "gold": [order.index(g) for g in rec.get("gold", [])]}

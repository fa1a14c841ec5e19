"""The training objectives (paper Sec. 2.4), registered by name like the eval systems: what each trains, which
fields its records need, how many decoder positions it takes, how a record becomes examples, and how generated text
is scored at evaluation. Adding one is one class here (it builds examples with a Builder, data.ExampleBuilder, in
the shapes of `example`)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar, Protocol

from transformers import PreTrainedTokenizerBase

from ..eval.metrics import answer_correct, bleu, rouge
from ..generation.text import words
from ..prompts import QA_PROMPT, SUMMARY_OF_DOCUMENT, SUMMARY_PROMPT, render_instruction
from .sources import Lengths, Source


@dataclass(frozen=True)
class Parts:
    """Which nugget parts an objective trains (the base model never does)."""

    encoder: bool
    decoder: bool
    scorer: bool
    soft_prompt: bool


FULL_CONTEXT_PARTS = Parts(encoder=False, decoder=True, scorer=False, soft_prompt=False)  # the uncompressed reference


class Builder(Protocol):
    """What an objective builds a source's examples with (data.ExampleBuilder)."""

    source: Source
    lengths: Lengths
    tok: PreTrainedTokenizerBase
    opening: list[int]  # the document opening (NuggetModel.document_opening)
    eos: list[int]

    def ids(self, text: str) -> list[int]: ...

    def state_positions(self, document_lengths: list[int], readings: list[float] | None = None) -> int: ...

    def task(self, documents: list[str], instruction: str, answer: str, references: list[str],
             extractive: bool = False, readings: list[float] | None = None,
             teacher_documents: list[str] | None = None) -> dict: ...


class Objective:
    """One objective. `generate_tokens`: the answer length at evaluation (None: no generation is scored)."""

    name: ClassVar[str] = ""
    parts: ClassVar[Parts]
    soft_prompt: ClassVar[bool] = False  # the decoder reads the soft prompt, then predicts from the first token
    generate_tokens: ClassVar[int | None] = None
    full_context: ClassVar[bool] = False  # whether the uncompressed reference (full_context=True) applies
    autoregressive: ClassVar[bool] = False  # read in autoregressive mode (NuggetStream), not compressed documents

    def fields(self, source: Source) -> list[tuple[str, ...]]:
        """Record fields it needs, each as the names that may hold it."""
        return [(source.text_field,)]

    def positions(self, builder: Builder) -> int:
        """Decoder positions an example may take (nuggets and tokens, without the prompt opening)."""
        L = builder.lengths
        return builder.state_positions([L.document]) + L.answer + 64

    def build(self, builder: Builder, row: dict, rows: list[dict], rng: random.Random) -> list[dict]:
        raise NotImplementedError

    def fixed_widths(self, source: Source, lengths: Lengths, eos: int) -> tuple[int, int, int] | None:
        """(documents per example, tokens per document, decoder tokens) that bound every example `build` makes (`eos`:
        the end-of-sequence tokens' count): the fixed shapes of the compiled training step (compiled_step.py).
        None: not bounded, so its micro-batches run eager."""
        return None

    def score(self, outputs: list[str], references: list[list[str]]) -> dict[str, float]:
        """Metrics of generated `outputs` against each example's references."""
        return {}


OBJECTIVES: dict[str, Objective] = {}


def register(name: str):
    """Class decorator: make an Objective available to `--data NAME:PATH` under `name`."""

    def wrap(cls: type[Objective]) -> type[Objective]:
        if name in OBJECTIVES and type(OBJECTIVES[name]) is not cls:
            raise ValueError(f"an objective named {name!r} is already registered")
        cls.name = name
        OBJECTIVES[name] = cls()
        return cls

    return wrap


def check_source(source: Source) -> None:
    """Refuse a source whose objective is not registered, or full_context where the objective has no reference."""
    if source.objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {source.objective!r}; registered: {', '.join(OBJECTIVES)}")
    if source.full_context and not OBJECTIVES[source.objective].full_context:
        applies = [name for name, objective in OBJECTIVES.items() if objective.full_context]
        raise ValueError(f"source {source.path}: full_context applies to {' and '.join(applies)}, "
                         f"not {source.objective}")


def parts_of(source: Source) -> Parts:
    return FULL_CONTEXT_PARTS if source.full_context else OBJECTIVES[source.objective].parts


@register("autoencoding")
class Autoencoding(Objective):
    """The decoder reconstructs the document after the soft prompt (a measure of what nuggets keep); all trains."""

    parts = Parts(encoder=True, decoder=True, scorer=True, soft_prompt=True)
    soft_prompt = True
    generate_tokens = 0  # the reference's length

    def positions(self, builder: Builder) -> int:
        size = builder.lengths.autoencoding
        return builder.state_positions([size]) + 1 + size + len(builder.eos)

    def build(self, builder, row, rows, rng):
        ids, size = builder.ids(row[builder.source.text_field]), builder.lengths.autoencoding
        chunks = [c for c in (ids[i : i + size] for i in range(0, len(ids), size)) if len(c) >= builder.lengths.min_document]
        if not chunks:
            return [skip("too short")]
        # the target ends with EOS: a reconstruction must learn to stop where the passage does
        return [example([c], c + builder.eos, 0, [builder.tok.decode(c)], builder.opening) for c in chunks]

    def fixed_widths(self, source, lengths, eos):
        return 1, lengths.autoencoding, lengths.autoencoding + eos

    def score(self, outputs, references):
        return {"bleu": round(bleu(outputs, [r[0] for r in references]), 2)}


@register("continuation")
class Continuation(Objective):
    """The decoder predicts a text's next tokens from the nuggets of its start and a few plain tokens; the decoder
    side stays frozen so that the LM keeps its skills."""

    parts = Parts(encoder=True, decoder=False, scorer=True, soft_prompt=False)

    def positions(self, builder: Builder) -> int:
        L = builder.lengths
        pieces = cut(list(range(L.document)), builder.source.documents_per_example)
        return builder.state_positions([len(piece) for piece in pieces]) + L.query + L.answer

    def build(self, builder, row, rows, rng):
        L = builder.lengths
        ids, window = builder.ids(row[builder.source.text_field]), L.document + L.query + L.answer
        examples = []
        for start in range(0, len(ids), window):
            piece = ids[start : start + window]
            answer = min(L.answer, (len(piece) - L.query) // 4)
            document = len(piece) - L.query - answer
            if answer < 1 or document < L.min_document:
                continue
            d, q, a = piece[:document], piece[document : document + L.query], piece[document + L.query :]
            examples.append(example(cut(d, builder.source.documents_per_example), q + a, len(q),
                                    [builder.tok.decode(a)], builder.opening))
        return examples or [skip("too short")]

    def fixed_widths(self, source, lengths, eos):
        pieces = source.documents_per_example
        return pieces, math.ceil(lengths.document / pieces), lengths.query + lengths.answer


@register("language_modeling")
class LanguageModeling(Objective):
    """Autoregressive mode (paper Sec. 2.2, Eq. 11): a text of `lengths.document` tokens read left to right by a
    NuggetStream (`TrainConfig.stream`), predicting every token that reads nuggets (those after the first window
    and segment); everything trains through the stream."""

    parts = Parts(encoder=True, decoder=True, scorer=True, soft_prompt=False)
    autoregressive = True

    def positions(self, builder: Builder) -> int:
        return 0  # the stream keeps its own positions inside the model's

    def build(self, builder, row, rows, rng):
        ids, size = builder.ids(row[builder.source.text_field]), builder.lengths.document
        pieces = [p for p in (ids[i : i + size] for i in range(0, len(ids), size)) if len(p) >= builder.lengths.min_document]
        return [example([], piece, 1, []) for piece in pieces] or [skip("too short")]


class PromptedTask(Objective):
    """Documents, an instruction in NuggetLLM's prompt, and a target answer (`Builder.task`): everything the
    task reads trains, and the uncompressed reference (full_context) applies."""

    parts = Parts(encoder=True, decoder=True, scorer=True, soft_prompt=False)
    full_context = True


@register("qa")
class QuestionAnswering(PromptedTask):
    """(passages, question, answer); other passages of the batch join as distractors."""

    generate_tokens = 64

    def fields(self, source):
        return [("context", "documents", source.context_field), ("question", source.question_field),
                ("answers", source.answer_field)]

    def build(self, builder, row, rows, rng):
        src = builder.source
        if "documents" in row:  # HotpotQA: the record brings its own passages
            docs = list(row["documents"])
        else:
            docs = [row["context"] if "context" in row else row[src.context_field]]
            others = sorted({r.get("context", r.get(src.context_field)) for r in rows} - {docs[0], None})
            rng.shuffle(others)
            docs += others[: src.documents_per_example - 1]
            rng.shuffle(docs)
        question = row.get("question", row.get(src.question_field))
        answers = row["answers"] if "answers" in row else row[src.answer_field]
        answers = [answers] if isinstance(answers, str) else list(answers)
        if question is None:
            raise KeyError(src.question_field)
        if not answers or not str(answers[0]).strip():
            return [skip("no answer")]
        return [builder.task(docs, render_instruction(QA_PROMPT, question), str(answers[0]), answers, extractive=True)]

    def score(self, outputs, references):
        correct = [answer_correct(o, r) for o, r in zip(outputs, references)]
        return {"accuracy": round(100 * sum(correct) / len(correct), 2)}


@register("rag_qa")
class RetrievedQuestionAnswering(PromptedTask):
    """A question's gold passage among its hardest same-article distractors (BM25 against the question, among the
    map batch's records), in that order, each read at its own ratio (`Source.readings`): the gold mostly whole beside
    skimmed distractors, sometimes skimmed too, sometimes absent (the target is then `no_gold_answer`). The teacher
    of distillation reads the gold passage alone as text (without one: the passages the student reads)."""

    generate_tokens = 64
    full_context = False  # its point is reading at mixed resolutions

    def fields(self, source):
        return [("context",), ("question",), ("answers",), ("article",)]

    def positions(self, builder):
        L = builder.lengths
        return builder.source.readings.passages * L.document + L.answer + 64

    def build(self, builder, row, rows, rng):
        settings = builder.source.readings
        gold, question, answers = row["context"], row["question"], [str(a) for a in row["answers"] if str(a).strip()]
        if not answers:
            return [skip("no answer")]
        same = sorted({r["context"] for r in rows if r["article"] == row["article"]} - {gold})
        from rank_bm25 import BM25Okapi

        passages = [words(p) or [""] for p in [gold, *same]]
        scores = BM25Okapi(passages).get_scores(words(question))
        ranked = sorted(range(len(passages)), key=lambda i: -scores[i])  # retriever order, the gold among them
        u = rng.random()
        if u < settings.no_gold:
            chosen = [i for i in ranked if i != 0][: settings.passages]
            if not chosen:
                return [skip("no distractor passage")]
            docs = [[gold, *same][i] for i in chosen]
            readings = [rng.choice(settings.skim_ratios) for _ in docs]
            return [builder.task(docs, render_instruction(QA_PROMPT, question), settings.no_gold_answer,
                                 [settings.no_gold_answer], readings=readings)]
        chosen = ranked[: settings.passages] if 0 in ranked[: settings.passages] else [*ranked[: settings.passages - 1], 0]
        chosen = sorted(chosen, key=ranked.index)
        docs = [[gold, *same][i] for i in chosen]
        gold_ratio = rng.choice(settings.skim_ratios if u < settings.no_gold + settings.gold_compressed
                                else settings.whole_ratios)
        readings = [gold_ratio if i == 0 else rng.choice(settings.skim_ratios) for i in chosen]
        return [builder.task(docs, render_instruction(QA_PROMPT, question), answers[0], answers, extractive=True,
                             readings=readings, teacher_documents=[gold])]

    def score(self, outputs, references):
        correct = [answer_correct(o, r) for o, r in zip(outputs, references)]
        return {"accuracy": round(100 * sum(correct) / len(correct), 2)}


@register("summarization")
class Summarization(PromptedTask):
    """(article, summary instruction, summary), as CNN/DailyMail.

    With `documents_per_example` d > 1, a digest: this record and up to d - 1 other records of its batch (other
    documents, each with a summary), in random order, each document compressed alone; the instruction is
    SUMMARY_OF_DOCUMENT, the summary chain's "nuggets" reading's, and the target is their summaries in the documents'
    order joined by a space. A space, not a line break: the nuggets reading decodes one paragraph (no stop string)
    and its output is returned as the summary, as the outline reading's sentences are joined by a space; a target of
    lines would teach the reading another shape than the chain's other readings return. (ROUGE-1/2/L, which scores
    summaries here, splits on whitespace alike.) A batch with fewer than d usable records gives fewer documents;
    d = 1 is the one-document example, SUMMARY_PROMPT."""

    generate_tokens = 128

    def fields(self, source):
        return [("document", source.document_field), ("summary", source.summary_field)]

    def positions(self, builder: Builder) -> int:
        L = builder.lengths
        return builder.state_positions([L.document] * builder.source.documents_per_example) + L.answer + 64

    def build(self, builder, row, rows, rng):
        document, summary = self._pair(builder.source, row)
        if not summary or not str(summary).strip():
            return [skip("no answer")]
        d = builder.source.documents_per_example
        if d == 1:
            return [builder.task([document], SUMMARY_PROMPT, summary, [summary])]
        others = {}  # document -> summary, in batch order (deterministic), this row's document left out
        for other in rows:
            text, written = self._pair(builder.source, other)
            if text and text != document and written and str(written).strip():
                others.setdefault(text, written)
        chosen = list(others.items())
        rng.shuffle(chosen)
        pairs = [(document, summary), *chosen[: d - 1]]
        rng.shuffle(pairs)
        target = " ".join(str(s).strip() for _, s in pairs)
        return [builder.task([doc for doc, _ in pairs], SUMMARY_OF_DOCUMENT, target, [target])]

    @staticmethod
    def _pair(source: Source, row: dict) -> tuple[str | None, str | None]:
        """A record's (document, summary): the `document`/`summary` fields, else the source's field names."""
        document = row["document"] if "document" in row else row[source.document_field]
        summary = row["summary"] if "summary" in row else row[source.summary_field]
        return document, summary

    def score(self, outputs, references):
        return {"rougeL": round(rouge(outputs, [r[0] for r in references])["rougeL"], 2)}


# ------------------------------------------------------------------ example shapes (data.py describes them)
def example(documents: list[list[int]], input_ids: list[int], target_start: int, references: list[str],
            prefix: list[int] | None = None, readings: list[float] | None = None,
            teacher_documents: list[list[int]] | None = None) -> dict:
    """`readings`: each document's own ratio (1: as text; [] = the batch's ratio for all); `teacher_documents`: what
    the distillation teacher reads instead of the documents ([] = the documents)."""
    return {"documents": documents, "prefix": prefix or [], "input_ids": input_ids, "target_start": target_start,
            "references": references, "readings": readings or [], "teacher_documents": teacher_documents or [],
            "skip": ""}


def skip(reason: str) -> dict:
    return {"documents": [], "prefix": [], "input_ids": [], "target_start": 0, "references": [], "readings": [],
            "teacher_documents": [], "skip": reason}


def cut(ids: list[int], pieces: int) -> list[list[int]]:
    size = math.ceil(len(ids) / pieces)
    return [ids[i : i + size] for i in range(0, len(ids), size)]

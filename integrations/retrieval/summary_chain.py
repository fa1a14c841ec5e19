"""Summaries of documents of any length from their nuggets: a LangChain Runnable, and the chain builder.

The text is cut into sections of at most `section_tokens` tokens at paragraph boundaries (the passages the
fine-tuned checkpoint learnt to read), each compressed alone and kept in the compressor's store, so that a second
summary, or a question about the same text, compresses nothing. Three readings of those nuggets (`SummaryReading`):
- "outline": the decoder writes one sentence a section from the section's nuggets, every section in one batched
  decode; the summary is those sentences in order;
- "sections" (map-reduce over nuggets): the outline's sentences, then the frozen model combines them into a few
  sentences (LangChain's "concise summary" prompt);
- "nuggets": the decoder reads every section's nuggets at once and writes the summary in one decode (paper App. D).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from typing import Any, get_args

from langchain_core.documents import Document
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import StrOutputParser
from langchain_core.runnables import Runnable, RunnableConfig, RunnableSerializable
from pydantic import ConfigDict, Field, field_validator
from transformers import PreTrainedTokenizerBase

from nugget_rag.components.compressor import CompressorInput, NuggetCompressor, as_documents
from nugget_rag.config import DECODER, PROBE_RATIO, NuggetConfig, SummaryReading
from nugget_rag.generation.decoding import GenerationSettings, RowSteps, generate, generation_steps
from nugget_rag.prompts import SUMMARY_OF_DOCUMENT, SUMMARY_PROMPT, chat_token_ids

from ..ingest.chunking import token_splitter

DEFAULT_READING: SummaryReading = get_args(SummaryReading)[0]  # chosen by measurement: BENCHMARKS.md
FINISH_SENTENCE = 32  # tokens past a limit to end the sentence it cut
COMBINE_PROMPT = 'Write a concise summary of the following:\n\n"{sections}"\n\nCONCISE SUMMARY:'  # LangChain's


class NuggetSummarizer(RunnableSerializable[CompressorInput, AIMessage]):
    """Summarises a text, a Document or several (read as one document, in order) from their nuggets.

    Output: an AIMessage (streamed as chunks) whose ``response_metadata`` says what was read: ``reading``,
    ``n_document_tokens``, ``n_sections``, ``n_nuggets``, ``compression_ratio`` (document tokens per nugget),
    ``cached`` (every state came from the store: nothing was compressed), ``compress_seconds`` and
    ``decode_seconds``, and for the outline and sections readings the ``section_summaries``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    compressor: NuggetCompressor
    reading: SummaryReading = Field(DEFAULT_READING, description="How the nuggets are read (module docstring).")
    ratio: float | None = Field(PROBE_RATIO, description="The ratio r the sections' nuggets are read at: default "
                                "the store's floor 4, which every stored state keeps (no extra bytes); None: the "
                                "compressor's ratio.")
    section_tokens: int = Field(512, ge=16, description="sections: a section's length in tokens at most (the "
                                "fine-tuned checkpoint read passages of up to 512 tokens).")
    section_max_new_tokens: int = Field(32, ge=1, description="A section's sentence, in tokens at most (then to "
                                        "its end).")
    max_new_tokens: int = Field(160, ge=1, description="The summary, in tokens at most (then to its sentence's end).")
    no_repeat_ngram_size: int = Field(3, ge=0, description="Never repeat an n-gram of this many tokens (0: off).")
    batch_size: int = Field(16, ge=1, description="Sections decoded in one batch.")

    @field_validator("ratio", mode="before")
    @classmethod
    def _check_ratio(cls, value: object) -> float | None:
        return None if value is None else NuggetConfig(ratio=value).ratio

    # ------------------------------------------------------------------ LangChain interface
    def invoke(self, input: CompressorInput, config: RunnableConfig | None = None, **kwargs: Any) -> AIMessage:
        final = None
        for chunk in self.stream(input, config, **kwargs):
            final = chunk if final is None else final + chunk
        return AIMessage(content=final.content, response_metadata=final.response_metadata,
                         usage_metadata=final.usage_metadata)

    def stream(self, input: CompressorInput, config: RunnableConfig | None = None,
               **kwargs: Any) -> Iterator[AIMessageChunk]:
        yield from self._transform_stream_with_config(iter([input]), self._transform, config, run_type="chain")

    def _transform(self, inputs: Iterator[CompressorInput]) -> Iterator[AIMessageChunk]:
        for value in inputs:
            yield from self.summarize(value)

    # ------------------------------------------------------------------ the readings
    def summarize(self, value: CompressorInput) -> Iterator[AIMessageChunk]:
        """The summary's pieces as they are decoded, the last chunk carrying the metadata."""
        docs = [d for d in as_documents(value) if d.page_content.strip()]
        if not docs:
            raise ValueError("there is nothing to summarise: every document given is empty or whitespace")
        started = time.perf_counter()
        parts = self.sections(docs)
        found = self.compressor.lookup(parts, self.ratio)
        states = [f.state for f in found]
        compressed = time.perf_counter()
        meta: dict[str, Any] = {"reading": self.reading}
        generated = 0  # tokens decoded: the section sentences', then each step's of a decode that follows
        if self.reading == "nuggets":
            steps, prompt_tokens = self._read_nuggets(states)
        else:
            sentences, generated = self._section_sentences(states)
            meta["section_summaries"] = sentences
            if self.reading == "outline":  # the summary is the sentences: no decode follows
                steps, prompt_tokens = RowSteps(iter([(" ".join(s for s in sentences if s), "stop")])), 0
            else:
                steps, prompt_tokens = self._combine(sentences)
        for piece in steps:
            generated += self.reading != "outline"
            if piece:
                yield AIMessageChunk(content=piece)
        n_tokens, n_nuggets = sum(s.n for s in states), sum(s.k for s in states)
        meta.update(n_document_tokens=n_tokens, n_sections=len(parts), n_nuggets=n_nuggets,
                    compression_ratio=n_tokens / n_nuggets, ratio=self.ratio or self.compressor.effective_ratio,
                    cached=all(f.cached for f in found), compress_seconds=round(compressed - started, 3),
                    decode_seconds=round(time.perf_counter() - compressed, 3), finish_reason=steps.finish_reason)
        read = prompt_tokens + n_nuggets
        yield AIMessageChunk(content="", response_metadata=meta, chunk_position="last", usage_metadata=UsageMetadata(
            input_tokens=read, output_tokens=generated, total_tokens=read + generated,
            input_token_details={"cache_read": sum(f.state.k for f in found if f.cached)}))

    def sections(self, documents: Sequence[Document]) -> list[Document]:
        """The documents cut at paragraph boundaries into sections of at most `section_tokens` tokens."""
        return cut_sections(self.compressor.model.tokenizer, documents, self.section_tokens)

    def _settings(self, max_new_tokens: int) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=max_new_tokens, finish_sentence=FINISH_SENTENCE, temperature=0,
                                  no_repeat_ngram_size=self.no_repeat_ngram_size)

    def _section_sentences(self, states: list) -> tuple[list[str], int]:
        """One sentence a section, the first the decoder writes from the section's nuggets (a batched decode that
        stops at a line break), and the tokens decoded."""
        model = self.compressor.model
        prefix, prompt = model.chat_prompt([{"role": "user", "content": SUMMARY_PROMPT}])
        settings = self._settings(self.section_max_new_tokens).model_copy(update={"stop": ["\n"]})
        written = []
        for start in range(0, len(states), self.batch_size):
            batch = states[start : start + self.batch_size]
            written += generate(model, [[s] for s in batch], [prompt] * len(batch), settings, adapter=DECODER,
                                prefixes=[prefix] * len(batch))
        decoded = sum(map(len, model.tokenizer(written, add_special_tokens=False)["input_ids"])) if written else 0
        return [first_sentence(text) for text in written], decoded

    def _combine(self, sentences: list[str]) -> tuple[RowSteps, int]:
        """The frozen model's summary of the section sentences, read as text: its steps and prompt tokens.
        Sentences too many for one prompt are combined a group at a time first, until they fit (as LangChain's
        map-reduce collapses)."""
        model = self.compressor.model
        budget = model.max_positions - self.max_new_tokens - FINISH_SENTENCE
        summaries = [s for s in sentences if s]
        prompt = self._combine_prompt(summaries)
        while len(prompt) > budget and len(summaries) > 1:
            groups = self._groups(summaries, budget)
            summaries = [text.strip() for text in generate(
                model, [[] for _ in groups], [self._combine_prompt(g) for g in groups],
                self._settings(self.section_max_new_tokens), adapter=None, prefixes=[None] * len(groups))]
            prompt = self._combine_prompt(summaries)
        if len(prompt) > budget:
            raise ValueError(f"one section's summary takes {len(prompt)} prompt tokens, more than the {budget} the "
                             f"model's {model.max_positions} positions leave; lower section_max_new_tokens")
        return self._steps([[]], prompt, None, None), len(prompt)

    def _combine_prompt(self, summaries: list[str]) -> list[int]:
        listed = "\n".join(f"- {s}" for s in summaries)
        return chat_token_ids(self.compressor.model.tokenizer,
                              [{"role": "user", "content": COMBINE_PROMPT.format(sections=listed)}])

    def _groups(self, summaries: list[str], budget: int) -> list[list[str]]:
        """Consecutive summaries in groups whose combine prompt fits `budget` tokens, each of two or more where
        two fit."""
        groups: list[list[str]] = [[]]
        for summary in summaries:
            if groups[-1] and len(self._combine_prompt([*groups[-1], summary])) > budget:
                groups.append([])
            groups[-1].append(summary)
        if any(len(self._combine_prompt(g)) > budget for g in groups) or len(groups) == len(summaries):
            raise ValueError(f"the section summaries cannot be combined within the model's "
                             f"{self.compressor.model.max_positions} positions; lower section_max_new_tokens")
        return groups

    def _read_nuggets(self, states: list) -> tuple[RowSteps, int]:
        """The decoder's summary from every state at once: its steps and prompt tokens."""
        prefix, prompt = self.compressor.model.chat_prompt([{"role": "user", "content": SUMMARY_OF_DOCUMENT}])
        return self._steps([states], prompt, prefix, DECODER), len(prefix) + len(prompt)

    def _steps(self, samples: list, prompt: list[int], prefix: list[int] | None, adapter: str | None) -> RowSteps:
        """One row's decoding steps: `samples`' states after `prefix`, then `prompt`, read with `adapter`."""
        steps = generation_steps(self.compressor.model, samples, [prompt], self._settings(self.max_new_tokens),
                                 adapter=adapter, prefixes=[prefix])
        return RowSteps((pieces[0], done[0]) for pieces, done in steps)


def cut_sections(tokenizer: PreTrainedTokenizerBase, documents: Sequence[Document],
                 section_tokens: int) -> list[Document]:
    """`documents` cut at paragraph boundaries into sections of at most `section_tokens` tokens of `tokenizer`, in
    order, blank ones left out: the sections a NuggetSummarizer reads (and the teacher summaries train on)."""
    splitter = token_splitter(tokenizer, section_tokens, 0)
    return [section for doc in documents for section in splitter.split_documents([doc])
            if section.page_content.strip()]


def first_sentence(text: str) -> str:
    """`text`'s first sentence (to its first '.', '!' or '?' before whitespace), or all of it stripped."""
    return re.split(r"(?<=[.!?])\s", text.strip(), maxsplit=1)[0]


def build_summary_chain(compressor: NuggetCompressor, reading: SummaryReading = DEFAULT_READING, as_text: bool = False,
                        **fields: Any) -> Runnable:
    """text or documents -> summary: a NuggetSummarizer over `compressor` (its store keeps the nuggets), returning
    the AIMessage, or its text with ``as_text=True``. `fields` are the summarizer's (`section_tokens`, ...)."""
    summarizer = NuggetSummarizer(compressor=compressor, reading=reading, **fields)
    return summarizer | StrOutputParser() if as_text else summarizer


__all__: list[str] = ["NuggetSummarizer", "SummaryReading", "build_summary_chain", "cut_sections", "first_sentence"]

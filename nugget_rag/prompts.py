"""Prompts of the paper (Appendix D), rendered in the model's chat template."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from string import Formatter

from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

QA_PROMPT = "Based on the provided document, answer the following question: {question}"
SUMMARY_PROMPT = "Please summarize the above document in one sentence."
# a long document's summary (the summary chain's "nuggets" reading, a digest's training target)
SUMMARY_OF_DOCUMENT = "Please summarize the above document in a few sentences."
LMSUMM_PROMPT = "Please summarize the following text into {words} words: {text}"


def check_template(template: str) -> str:
    """`template` if it has no placeholder other than `{question}`, else a ValueError naming the problem."""
    _question_field(template)
    return template


def takes_question(template: str) -> bool:
    """Whether `template` has the `{question}` placeholder (a fixed instruction, such as SUMMARY_PROMPT, has none)."""
    return _question_field(template)


def _question_field(template: str) -> bool:
    """Whether `template` has the `{question}` placeholder; a ValueError for any other placeholder."""
    fields = {name for _, name, _, _ in Formatter().parse(template) if name is not None}
    if fields - {"question"}:
        raise ValueError(f"prompt template {template!r} has placeholder(s) {sorted(fields - {'question'})}, but only "
                         "{question} is filled; remove them (write literal braces doubled: {{ }})")
    return bool(fields)


def render_instruction(template: str, question: str) -> str:
    """Fill `{question}` of a prompt template; a template without it (a fixed instruction such as SUMMARY_PROMPT)
    is used as it is, and then takes no question."""
    if _question_field(template):
        return template.format(question=question)
    if question.strip():
        raise ValueError(f"prompt template {template!r} has no {{question}} placeholder, so the question "
                         f"{question[:60]!r} would be dropped; add {{question}} to the template, or pass an empty one")
    return template.format()


def full_context_messages(documents: Sequence[str], instruction: str) -> list[dict[str, str]]:
    """The uncompressed reference prompt (Full): the documents' text, then the instruction, in one user turn."""
    return [{"role": "user", "content": "\n\n".join([*documents, instruction])}]


def chat_text(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> str:
    """`messages` ({role, content} dicts) rendered in the chat template, ready for the assistant's reply."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    _warn_no_template(tokenizer.name_or_path)
    bos = tokenizer.bos_token or ""  # ids are made without special tokens: a base model still gets its BOS
    return bos + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


@functools.cache
def _warn_no_template(name: str) -> None:
    log.warning("the tokenizer of %s has no chat template; prompts use a plain 'role: text' format, which a model "
                "not trained on it may read poorly", name)


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of `messages` in the chat template, ready for the assistant's reply."""
    return tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"]

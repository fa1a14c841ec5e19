"""Prompts of the paper (Appendix D), rendered in the model's chat template."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

QA_PROMPT = "Based on the provided document, answer the following question: {question}"
SUMMARY_PROMPT = "Please summarize the above document in one sentence."
LMSUMM_PROMPT = "Please summarize the following text into {words} words: {text}"


def render_instruction(template: str, question: str) -> str:
    """Fill `{question}` of a prompt template; a template without the placeholder is used as it is."""
    return template.format(question=question) if "{question}" in template else template


def full_context_messages(documents: Sequence[str], instruction: str) -> list[dict[str, str]]:
    """The uncompressed reference prompt (Full): the documents' text, then the instruction, in one user turn."""
    return [{"role": "user", "content": "\n\n".join([*documents, instruction])}]


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of `messages` ({role, content} dicts) in the chat template, ready for the assistant's reply."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return tokenizer(text, add_special_tokens=False)["input_ids"]

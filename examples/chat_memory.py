"""A chat that keeps its older turns as nuggets and its recent ones verbatim (autoregressive mode as chat memory).

    python examples/chat_memory.py
    python examples/chat_memory.py --window 64 --checkpoint my-checkpoint/

NuggetStreamLLM reads the conversation left to right: the last `window` tokens stay whole, everything older
survives as nuggets (about 1 in r tokens). It keeps the stream of each conversation, so every turn reads only the
new messages (`cache_read` counts the tokens it did not read again), and the states a reply attends to grow by
about 1/r of the conversation instead of all of it. The model is the memory: the caller passes the whole history,
as to any chat model, and pays only for what is new.
"""

from __future__ import annotations

import argparse
import sys

from langchain_core.messages import BaseMessage, HumanMessage

from nugget_rag import NuggetStreamLLM
from nugget_rag.cli.options import add_checkpoint_option

TURNS = [
    "My name is Ada and I keep bees in Lisbon. What do bees need to get through the winter?",
    "How many hives should a beginner start with?",
    "Remind me: what is my name, and where do I keep my bees?",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_option(parser)
    parser.add_argument("--window", type=int, default=32, help="tokens kept whole (default 32)")
    parser.add_argument("--ratio", type=float, help="compression ratio r of older turns (default: the model's)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    llm = NuggetStreamLLM.from_pretrained(args.checkpoint, reading={"window": args.window, "ratio": args.ratio},
                                          max_new_tokens=args.max_new_tokens, no_repeat_ngram_size=3)
    history: list[BaseMessage] = []
    for turn in TURNS:
        history.append(HumanMessage(turn))
        answer = llm.invoke(history)
        history.append(answer)
        usage, meta = answer.usage_metadata, answer.response_metadata
        print(f"user: {turn}\nassistant: {answer.content.strip()}")
        print(f"  [prompt {usage['input_tokens']} tokens, {usage['input_token_details']['cache_read']} already read; "
              f"the reply attended to {meta['kv_size']} states: {meta['n_nuggets']} nuggets + recent tokens]\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

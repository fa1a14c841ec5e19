"""Summarise one long document from its nuggets, in a small LCEL pipeline.

    python examples/summarize_long_document.py                 # "Compound statements": 12,346 tokens on 3.11
    python examples/summarize_long_document.py --mode autoregressive   # the same, read in one left-to-right pass
    python examples/summarize_long_document.py --topic specialnames    # another topic of Python's reference
    python examples/summarize_long_document.py ../shared/data/cnndm-test-250.jsonl --line 17   # a news article
    python examples/summarize_long_document.py report.txt --checkpoint my-checkpoint/

The default document is a topic of the language reference that every Python carries offline (`pydoc_data.topics`,
what `help("if")` shows), so the example runs on a fresh clone with nothing beside it. It is longer than the
model's 8,192 positions, so the plain model cannot read it whole.
- compressor mode (default): the document is compressed once into nuggets (about 1 in r tokens; a document longer
  than the positions is cut into segments, each compressed alone, and their nuggets joined); the decoder then reads
  only the nuggets and the summary instruction (Dodo paper, Appendix D). The nuggets can be stored and reused.
- autoregressive mode (paper Sec. 2.2): NuggetStreamLLM reads the whole prompt, document and instruction, left to
  right; the last `window` tokens stay whole and everything older survives as nuggets, so the instruction is read
  verbatim after a compressed document.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda

from nugget_rag import SUMMARY_PROMPT, NuggetLLM, NuggetStreamLLM
from nugget_rag.cli_options import add_checkpoint_option
from nugget_rag.integrations import load_compressor

DEFAULT_TOPIC = "compound"  # "Compound statements": 12,346 tokens on Python 3.11, past the model's 8,192


def reference_topic(name: str) -> Document:
    """A topic of the Python language reference (`pydoc_data.topics`, shipped with Python)."""
    from pydoc_data.topics import topics

    if name not in topics:
        raise SystemExit(f"--topic {name!r} is not a topic of pydoc_data.topics; try one of "
                         f"{', '.join(sorted(topics, key=lambda t: -len(topics[t]))[:5])}")
    return Document(page_content=topics[name], metadata={"source": f"pydoc_data.topics[{name!r}]"})


def read_document(path: Path, line: int | None, record_id: str | None) -> tuple[Document, str | None]:
    """A JSONL record (by `line`, else by `record_id`, else the first; field "article" or "text") with its
    highlights if any, or a whole text file."""
    if path.suffix != ".jsonl":
        return Document(page_content=path.read_text(encoding="utf-8"), metadata={"source": str(path)}), None
    if line is None and record_id is None:
        line = 0
    with path.open(encoding="utf-8") as f:
        for i, raw in enumerate(f):
            record = json.loads(raw)
            if i == line or (line is None and record.get("id") == record_id):
                text = record.get("article") or record.get("text")
                if not text:
                    raise SystemExit(f"{path}:{i + 1} has no \"article\" or \"text\" field")
                source = f"{path.name}:{record.get('id') or i}"
                return Document(page_content=text, metadata={"source": source}), record.get("highlights")
    raise SystemExit(f"{path} has no line {line}" if line is not None else f"{path} has no record with id {record_id!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path,
                        help="a text file, or a JSONL of documents (default: --topic of Python's reference)")
    parser.add_argument("--topic", default=DEFAULT_TOPIC,
                        help=f"with no path: which topic of pydoc_data.topics (default {DEFAULT_TOPIC})")
    parser.add_argument("--line", type=int, help="which JSONL line (0-based; default: the first)")
    parser.add_argument("--id", help="which JSONL record, by its id")
    add_checkpoint_option(parser)
    parser.add_argument("--ratio", type=float, help="compression ratio r (default: the model's)")
    parser.add_argument("--mode", choices=["compressor", "autoregressive"], default="compressor",
                        help="compress the document, then read its nuggets (default); or read it all in one pass")
    parser.add_argument("--window", type=int, default=128, help="autoregressive mode: tokens kept whole")
    parser.add_argument("--max-new-tokens", type=int, default=60)
    parser.add_argument("--no-repeat-ngram-size", type=int, default=3,
                        help="never repeat an n-gram of the summary (default 3, as BART's CNN/DailyMail setting; "
                             "0: plain greedy decoding)")
    args = parser.parse_args()

    if args.path is None:
        document, reference = reference_topic(args.topic), None
    elif not args.path.exists():
        print(f"{args.path} not found. Pass a text file (or a JSONL with an \"article\" field), e.g.\n"
              f"    python {Path(__file__).name} my_report.txt", file=sys.stderr)
        return 2
    else:
        document, reference = read_document(args.path, args.line, args.id)
    if not document.page_content.strip():
        print(f"{document.metadata['source']} is empty or whitespace: there is nothing to summarise", file=sys.stderr)
        return 2

    if args.mode == "autoregressive":
        return summarize_in_one_pass(document, args)
    compressor = load_compressor(args.checkpoint, ratio=args.ratio)
    llm = NuggetLLM(compressor=compressor, prompt_template=SUMMARY_PROMPT, max_new_tokens=args.max_new_tokens,
                    no_repeat_ngram_size=args.no_repeat_ngram_size)
    summarize = (
        {"documents": compressor, "question": RunnableLambda(lambda _: "")}  # the prompt has no {question}
        | llm
        | StrOutputParser()
    )
    print(f"Summary of {document.metadata['source']}:\n  ", end="", flush=True)
    for piece in summarize.stream([document]):
        print(piece, end="", flush=True)
    print()

    state = compressor.states([document])[0]  # from the store: not compressed twice
    positions = compressor.model.max_positions
    print(f"\nCompression: {state.n} tokens ({state.n / positions:.1f}x the model's {positions} positions) -> "
          f"{state.k} nuggets (r = {state.n / state.k:.1f}); their keys/values take {state.nbytes / 2**20:.1f} MiB, "
          f"the whole text's would take {state.nbytes * state.n / state.k / 2**20:.0f} MiB")
    if reference:
        print(f"Reference highlights:\n  {reference.strip().replace(chr(10), chr(10) + '  ')}")
    return 0


def summarize_in_one_pass(document: Document, args: argparse.Namespace) -> int:
    llm = NuggetStreamLLM.from_pretrained(args.checkpoint, reading={"window": args.window, "ratio": args.ratio},
                                          max_new_tokens=args.max_new_tokens,
                                          no_repeat_ngram_size=args.no_repeat_ngram_size)
    prompt = ChatPromptTemplate.from_messages([("user", "{document}\n\n" + SUMMARY_PROMPT)])
    print(f"Summary of {document.metadata['source']} (read in one pass):\n  ", end="", flush=True)
    final = None
    for chunk in (prompt | llm).stream({"document": document.page_content}):
        print(chunk.content, end="", flush=True)
        final = chunk if final is None else final + chunk
    meta, positions = final.response_metadata, llm.model.max_positions
    print(f"\n\nRead {meta['tokens_read']} tokens ({meta['tokens_read'] / positions:.1f}x the model's {positions} "
          f"positions); the last token attended to {meta['kv_size']} key/value states: {meta['n_nuggets']} nuggets "
          f"and the {args.window} most recent tokens whole")
    return 0


if __name__ == "__main__":
    sys.exit(main())

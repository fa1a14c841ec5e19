"""Summarise one long document from its nuggets, in a LangChain pipeline.

    python examples/summarize_long_document.py                 # "Compound statements": 12,346 tokens on 3.11
    python examples/summarize_long_document.py --reading nuggets        # every nugget read in one decode
    python examples/summarize_long_document.py --reading autoregressive # the text read left to right in one pass
    python examples/summarize_long_document.py --topic specialnames    # another topic of Python's reference
    python examples/summarize_long_document.py ../shared/data/cnndm-test-250.jsonl --line 17   # a news article
    python examples/summarize_long_document.py report.txt --checkpoint my-checkpoint/

The default document is a topic of the language reference that every Python carries offline (`pydoc_data.topics`,
what `help("if")` shows), so the example runs on a fresh clone with nothing beside it. It is longer than the
model's 8,192 positions, so the plain model cannot read it whole.
- outline, sections, nuggets (integrations/retrieval/summary_chain.py): the document is cut into sections of up to 512
  tokens, each compressed once into nuggets (about 1 in r tokens) and stored; the decoder writes a sentence a
  section from its nuggets (outline), which the frozen model may then combine (sections), or reads every nugget at
  once (nuggets). A second summary reads the stored nuggets: it compresses nothing.
- autoregressive (paper Sec. 2.2): NuggetStreamLLM reads the whole prompt, document and instruction, left to
  right; the last `window` tokens stay whole and everything older survives as nuggets.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate

from nugget_rag import NuggetStreamLLM
from nugget_rag.cli.options import add_checkpoint_option
from nugget_rag.integrations import NuggetSummarizer, build_summary_chain, load_compressor
from nugget_rag.prompts import SUMMARY_OF_DOCUMENT

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
    parser.add_argument("--ratio", type=float, help="the ratio r the nuggets are read at (default: the summarizer's)")
    parser.add_argument("--reading", choices=["outline", "sections", "nuggets", "autoregressive"],
                        default=NuggetSummarizer.model_fields["reading"].default,
                        help="how the nuggets are read (default: the measured best, BENCHMARKS.md)")
    parser.add_argument("--window", type=int, default=128, help="autoregressive reading: tokens kept whole")
    parser.add_argument("--again", action="store_true", help="summarise twice: the second reads the stored nuggets")
    parser.add_argument("--max-new-tokens", type=int, default=160)
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

    if args.reading == "autoregressive":
        return summarize_in_one_pass(document, args)
    compressor = load_compressor(args.checkpoint)
    chosen = {"ratio": args.ratio} if args.ratio else {}  # default: the summarizer's (the store's floor, 4)
    summarize = build_summary_chain(compressor, reading=args.reading, max_new_tokens=args.max_new_tokens, **chosen)
    print(f"Summary of {document.metadata['source']} ({args.reading} reading):\n  ", end="", flush=True)
    final = None
    for chunk in summarize.stream([document]):
        print(chunk.content, end="", flush=True)
        final = chunk if final is None else final + chunk
    meta, positions = final.response_metadata, compressor.model.max_positions
    print(f"\n\nCompression: {meta['n_document_tokens']} tokens ({meta['n_document_tokens'] / positions:.1f}x the "
          f"model's {positions} positions) in {meta['n_sections']} sections -> {meta['n_nuggets']} nuggets "
          f"(r = {meta['compression_ratio']:.1f}), in {meta['compress_seconds']:.1f} s; summarised in "
          f"{meta['decode_seconds']:.1f} s")
    if args.again:
        again = summarize.invoke([document]).response_metadata
        print(f"A second summary read every nugget from the store ({again['cached']}) and took "
              f"{again['compress_seconds'] + again['decode_seconds']:.1f} s")
    else:
        sections = NuggetSummarizer(compressor=compressor).sections([document])
        stored = all(found.cached for found in compressor.lookup(sections, meta["ratio"]))
        print(f"Every section's nuggets are in the store ({stored}): a second summary (--again) or a question "
              "about the document compresses nothing")
    if reference:
        print(f"Reference highlights:\n  {reference.strip().replace(chr(10), chr(10) + '  ')}")
    return 0


def summarize_in_one_pass(document: Document, args: argparse.Namespace) -> int:
    llm = NuggetStreamLLM.from_pretrained(args.checkpoint, reading={"window": args.window, "ratio": args.ratio},
                                          max_new_tokens=args.max_new_tokens, no_repeat_ngram_size=3)
    prompt = ChatPromptTemplate.from_messages([("user", "{document}\n\n" + SUMMARY_OF_DOCUMENT)])
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

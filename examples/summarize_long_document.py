"""Summarise one long document from its nuggets, in a small LCEL pipeline.

    python examples/summarize_long_document.py                 # a CNN/DailyMail article (train range)
    python examples/summarize_long_document.py --line 17
    python examples/summarize_long_document.py report.txt --checkpoint my-checkpoint/

The document is compressed once into nuggets (about 1 in r tokens); the decoder then reads only the nuggets
and the summary instruction (Dodo paper, Appendix D).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.runnables import RunnableLambda

from nugget_rag import SUMMARY_PROMPT, NuggetLLM
from nugget_rag.cli import add_checkpoint_option
from nugget_rag.integrations import load_compressor

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data" / "cnndm-test-250.jsonl"
TRAIN_LINES = range(0, 200)  # the file's train part; lines 200+ are for development and tests


def read_document(path: Path, line: int) -> tuple[Document, str | None]:
    """A CNN/DailyMail article (JSONL line `line`, field "article") with its highlights, or a whole text file."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for i, raw in enumerate(f):
                if i == line:
                    record = json.loads(raw)
                    text = record.get("article") or record.get("text")
                    if not text:
                        raise SystemExit(f"{path}:{line + 1} has no \"article\" or \"text\" field")
                    return Document(page_content=text, metadata={"source": f"{path.name}:{line}"}), \
                        record.get("highlights")
        raise SystemExit(f"{path} has fewer than {line + 1} lines")
    return Document(page_content=path.read_text(encoding="utf-8"), metadata={"source": str(path)}), None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_DATA,
                        help="a text file, or a JSONL of articles (default: CNN/DailyMail in ../shared/data)")
    parser.add_argument("--line", type=int, default=0, help="which JSONL line (default 0; train range 0-199)")
    add_checkpoint_option(parser)
    parser.add_argument("--ratio", type=float, help="compression ratio r (default: the model's)")
    parser.add_argument("--max-new-tokens", type=int, default=60)
    parser.add_argument("--no-repeat-ngram-size", type=int, default=3,
                        help="never repeat an n-gram of the summary (default 3, as BART's CNN/DailyMail setting; "
                             "0: plain greedy decoding)")
    args = parser.parse_args()

    if not args.path.exists():
        print(f"{args.path} not found. Pass a text file (or a JSONL with an \"article\" field), e.g.\n"
              f"    python {Path(__file__).name} my_report.txt", file=sys.stderr)
        return 2
    if args.path.resolve() == DEFAULT_DATA.resolve() and args.line not in TRAIN_LINES:
        print(f"note: line {args.line} is outside the train range 0-199 of {DEFAULT_DATA.name} "
              "(200+ are kept for evaluation)", file=sys.stderr)
    document, reference = read_document(args.path, args.line)
    if not document.page_content.strip():
        print(f"{document.metadata['source']} is empty or whitespace: there is nothing to summarise", file=sys.stderr)
        return 2

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

    stats = compressor.invoke([document])[0].metadata["nuggets"]  # from the store: not compressed twice
    print(f"\nCompression: {stats['n_tokens']} tokens -> {stats['n_nuggets']} nuggets "
          f"(r = {stats['n_tokens'] / stats['n_nuggets']:.1f}; store: {compressor.store.stats})")
    if reference:
        print(f"Reference highlights:\n  {reference.strip().replace(chr(10), chr(10) + '  ')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

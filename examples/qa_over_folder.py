"""Question answering over a folder of documents: FAISS retrieval + Dodo nuggets + streamed answers.

    python examples/qa_over_folder.py                       # Python's language reference, as Python ships it
    python examples/qa_over_folder.py my_notes/ -q "What did we decide about the launch?"
    python examples/qa_over_folder.py ../shared/data/python-3.11-docs.jsonl --docs 5 --checkpoint my-checkpoint/

With no path it reads eight topics of the language reference that every Python carries offline
(`pydoc_data.topics`, what `help("pass")` shows), so it runs on a fresh clone with nothing else beside it.

Documents are split into 384-token chunks, embedded with all-MiniLM-L6-v2 and compressed into nuggets once;
the index (and its nuggets) stays in --index, so a second run answers at once.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

from langchain_core.documents import Document

from nugget_rag import NuggetLLM
from nugget_rag.cli.options import add_checkpoint_option
from nugget_rag.integrations import (
    NuggetIndex,
    build_qa_chain,
    load_compressor,
    load_documents,
    load_jsonl,
    minilm_embeddings,
    source_label,
)
from nugget_rag.resolution import RESOLUTIONS

DEFAULT_TOPICS = ["pass", "for", "while", "lambda", "return", "del", "assert", "with"]
DEFAULT_QUESTIONS = [
    "What does the pass statement do?",
    "When does the else clause of a for loop run?",
    "What does a lambda expression create?",
]


def reference_topics(names: list[str]) -> list[Document]:
    """Topics of the Python language reference (`pydoc_data.topics`, shipped with Python), one Document each."""
    from pydoc_data.topics import topics

    return [Document(page_content=topics[name], metadata={"source": f"pydoc_data.topics[{name!r}]"}, id=name)
            for name in names]


def pick_documents(path: Path | None, count: int, max_chars: int | None) -> list[Document]:
    """The first `count` documents of `path` (JSONL, or a folder or file of text), or of the default topics."""
    if path is None:
        docs = reference_topics(DEFAULT_TOPICS)[:count]
    elif path.suffix == ".jsonl":
        docs = list(itertools.islice(load_jsonl(path), count))
    else:
        docs = load_documents([path])[:count]
    if max_chars:
        for doc in docs:
            doc.page_content = doc.page_content[:max_chars]
    return docs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path,
                        help="a folder of text files or a JSONL file ({\"text\", \"id\"} a line); default: "
                             f"{len(DEFAULT_TOPICS)} topics of Python's language reference (pydoc_data.topics)")
    parser.add_argument("-q", "--question", action="append", help="a question (repeatable)")
    parser.add_argument("--docs", type=int, default=len(DEFAULT_TOPICS),
                        help=f"how many documents to index (default {len(DEFAULT_TOPICS)})")
    parser.add_argument("--max-chars", type=int, default=12000,
                        help="keep the first N characters of each document, to stay fast on CPU (0: all)")
    parser.add_argument("--index", type=Path, default=Path(tempfile.gettempdir()) / "nugget-rag-qa-example")
    add_checkpoint_option(parser)
    parser.add_argument("-k", type=int, default=3, help="chunks retrieved per question (--resolution reads, "
                        "skims or drops each)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--resolution", choices=RESOLUTIONS, default="default",
                        help="how finely each chunk is read: the best measured policy (default), all at the index's "
                             "ratio (uniform), or a policy of nugget_rag.resolution")
    args = parser.parse_args()

    if args.path is not None and not args.path.exists():
        print(f"{args.path} not found. Pass a folder of text files or a JSONL file, e.g.\n"
              f"    python {Path(__file__).name} path/to/docs/", file=sys.stderr)
        return 2
    docs = pick_documents(args.path, args.docs, args.max_chars)
    if not docs:
        print(f"no documents found in {args.path or 'the default topics'}", file=sys.stderr)
        return 2

    compressor = load_compressor(args.checkpoint)
    index = NuggetIndex.open(args.index, compressor, minilm_embeddings(), show_progress=True)
    added = index.ingest(docs)
    index.save(args.index)
    print(f"{len(docs)} documents -> {index.last_ingest['chunks']} chunks ({added} newly compressed); "
          f"index and nuggets in {args.index}\n")

    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=args.max_new_tokens)
    chain = build_qa_chain(index, llm, k=args.k, resolution=args.resolution)
    for question in args.question or DEFAULT_QUESTIONS:
        print(f"Q: {question}\nA: ", end="", flush=True)
        answer = None
        for chunk in chain.stream(question):
            print(chunk.content, end="", flush=True)
            answer = chunk if answer is None else answer + chunk
        readings = {r["index"]: r["reason"] for r in answer.response_metadata.get("resolution", [])}
        print("\nSources:")
        for meta in answer.response_metadata["sources"]:
            print(f"  {source_label(meta)}" + (f"  [{readings[meta['index']]}]" if meta["index"] in readings else ""))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

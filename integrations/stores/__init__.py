"""The vector stores a NuggetIndex keeps its chunks' vectors in, and the embeddings that make them: the user's own
store built from its spec (spec.py), the chunks as every store takes them (user_store.py), the offline MiniLM
embeddings (embeddings.py). Imports no other part of integrations/."""

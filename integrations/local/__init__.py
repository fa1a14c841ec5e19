"""The local index: a NuggetIndex of chunks and their nuggets (index.py), its files and update lock (files.py), its
settings (settings.py), its own FAISS (own_faiss.py), its retriever (retriever.py), and re-flooring it (refloor.py).
Over stores/ and ingest/; nothing here imports published/."""

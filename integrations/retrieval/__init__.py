"""What a question gets: the QA chain over an index and its one assembly for every caller (qa_chain.py), and views
of how each passage was read and which tokens became nuggets (visualize.py)."""

"""The chains over the store and what they show: the QA chain over an index and its one assembly for every caller
(qa_chain.py), the summary of a long document read as nuggets (summary_chain.py), and views of how each passage was
read and which tokens became nuggets (visualize.py)."""

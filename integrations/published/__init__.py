"""The index published in a nugget store: its layout in segments (segments.py), a publish (publishing.py) under its
lock (lock.py), what a publish checks before its commit (verify.py), the PublishedIndex that reads and adds to it
(index.py), its check and repair (check.py), pruning the store (prune.py), and the index a setting names: a directory
or the published one (named.py). Over the local index and the stores."""

"""`python -m nugget_rag.train ...` is `nugget-rag train ...`; with accelerate: `accelerate launch -m nugget_rag.train`."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

"""`python -m nugget_rag.eval ...` is `nugget-rag eval ...`."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))

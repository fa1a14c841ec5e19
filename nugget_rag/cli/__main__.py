"""`python -m nugget_rag.cli ...` is `nugget-rag ...`."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())

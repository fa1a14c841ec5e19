"""`python -m nugget_rag.eval ...` is `nugget-rag eval ...`."""

import sys

from .cli import main

sys.exit(main())

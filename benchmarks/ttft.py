"""Time to first token, Full vs cached nuggets: now measured by the evaluation harness's speed part.

    python benchmarks/ttft.py [more nugget-rag eval options]

is a shortcut for

    nugget-rag eval --tasks speed --ratios 10 --speed-docs 1 4 16 --speed-repeats 5 --name ttft --out-dir benchmarks/results

which also reports per-token decode latency, key/value bytes, compression throughput and store hit latency, and
writes benchmarks/results/ttft.{json,md} and a TTFT-vs-documents plot. See nugget_rag/eval/speed.py.
"""

from __future__ import annotations

import sys

from nugget_rag.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "--tasks", "speed", "--ratios", "10", "--speed-docs", "1", "4", "16", "--speed-repeats", "5",
                   "--name", "ttft", "--out-dir", "benchmarks/results", *sys.argv[1:]]))

"""Bytes a store keeps per document token, by floor (`NuggetCompressor.keep_ratio`) and key/value format.

    python benchmarks/state_bytes.py --documents 4 --tokens 512

Compresses the first Python-docs test passages once at floor 1 (every position, in resolution order), cuts the
state to each coarser floor (`NuggetState.with_floor`) and serialises it in each format, as the store writes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_out_option, run_meta, table, write_report  # noqa: E402

from nugget_rag import NuggetModel  # noqa: E402
from nugget_rag.corpora import read_documents  # noqa: E402
from nugget_rag.state import KV_FORMATS  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "python-3.11-docs.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--floors", type=float, nargs="+", default=[1, 2, 4, 10])
    parser.add_argument("--data", type=Path, default=DATA)
    add_out_option(parser)
    args = parser.parse_args()
    model = NuggetModel.from_pretrained("default", dtype="float32")
    texts = read_documents(args.data, "test")[: args.documents]
    ids = [model.tokenizer(r["text"], add_special_tokens=False)["input_ids"][: args.tokens] for r in texts]
    with torch.inference_mode():
        states = model.compress(ids, ratio=1, ranked=True)
    tokens = sum(map(len, ids))
    rows = {f"{floor:g}": {fmt: sum(len(s.with_floor(floor).compact(fmt).to_bytes()) for s in states) / tokens
                           for fmt in KV_FORMATS} for floor in args.floors}
    text = "\n".join(table(["floor", *KV_FORMATS],
                           ([floor, *(f"{b:,.0f}" for b in sizes.values())] for floor, sizes in rows.items()))) + "\n"
    write_report(args.out, {"meta": run_meta(tokens=tokens), "bytes_a_token": rows}, text)

if __name__ == "__main__":
    main()

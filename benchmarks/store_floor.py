"""The README example's index on disk at each store floor (`keep_ratio`), side by side: the same documents
(examples/qa_over_folder.py's default topics) ingested into a fresh index per floor, the default model.

    python benchmarks/store_floor.py [--floors 1 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent / "examples")]

from qa_over_folder import DEFAULT_TOPICS, pick_documents  # noqa: E402
from reporting import add_out_option, run_meta, table, write_report  # noqa: E402

from nugget_rag.integrations import NuggetIndex, load_compressor, minilm_embeddings  # noqa: E402
from nugget_rag.integrations.local.files import NUGGETS_DIR  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floors", type=float, nargs="+", default=[1.0, 4.0])
    add_out_option(parser)
    args = parser.parse_args()
    docs = pick_documents(None, len(DEFAULT_TOPICS), 12000)  # the example's defaults
    compressor, embeddings = load_compressor(), minilm_embeddings()
    rows = []
    for floor in args.floors:
        with tempfile.TemporaryDirectory() as tmp:
            index = NuggetIndex.open(tmp, compressor.model_copy(update={"keep_ratio": floor}), embeddings)
            index.ingest(docs)
            index.save(tmp)
            size = sum(p.stat().st_size for p in (Path(tmp) / NUGGETS_DIR).rglob("*") if p.is_file())
            rows.append((floor, index.last_ingest["chunks"], index.last_ingest["tokens"], size))
    text = "\n".join(table(["keep_ratio", "chunks", "tokens", "store bytes", "bytes a token", "vs the first"],
                           ([f"{floor:g}", chunks, f"{tokens:,}", f"{size:,}", f"{size / tokens:,.0f}",
                             f"{rows[0][3] / size:.2f}x smaller"] for floor, chunks, tokens, size in rows))) + "\n"
    write_report(args.out, {"meta": run_meta(), "rows": [dict(zip(("keep_ratio", "chunks", "tokens", "store_bytes"), row))
                                                         for row in rows]}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

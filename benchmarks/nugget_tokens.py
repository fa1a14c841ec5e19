"""Which tokens the Scorer keeps as nuggets (paper Sec. 4.3, Fig. 5), side by side for several checkpoints.

    python benchmarks/nugget_tokens.py --checkpoints none default runs/finetune-r10/final \\
        --data ../shared/data/python-3.11-docs.jsonl --split dev --documents 64

Each checkpoint compresses the same documents (cut to --tokens tokens) at its own r. Reported per checkpoint:
the token types most often kept, their share of the nuggets and of the text, how much of the selection the top
10 types cover (the paper: 95% for its trained Scorer), the share of punctuation, and the spread of the gaps
between consecutive nuggets. Writes benchmarks/results/<name>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import string
import sys
from collections import Counter
from pathlib import Path

import matplotlib
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_name_options, made_by, run_meta, table, write_report  # noqa: E402

from nugget_rag.cli.options import checkpoint_arg  # noqa: E402
from nugget_rag.corpora import read_documents  # noqa: E402
from nugget_rag.model import NuggetModel  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TOP = 10
SPACE = "\u2423"  # the open-box sign


def token_label(tokenizer, token_id: int) -> str:
    """A token's text with its spaces shown as '␣' (so ' the' and 'the' stay apart)."""
    text = tokenizer.decode([token_id])
    return repr(text.replace(" ", SPACE))[1:-1] or "''"


def selection_statistics(model: NuggetModel, documents: list[list[int]], batch_size: int) -> dict:
    """Counts of the token types kept as nuggets and of all tokens, and the gaps between nuggets."""
    kept, seen, gaps = Counter(), Counter(), []
    for start in tqdm(range(0, len(documents), batch_size), desc="compressing", leave=False):
        batch = documents[start : start + batch_size]
        with torch.no_grad():
            states = model.compress(batch)
        for ids, state in zip(batch, states):
            positions = state.positions.tolist()
            kept.update(ids[p] for p in positions)
            seen.update(ids)
            gaps += [b - a for a, b in zip(positions, positions[1:])]
    label = {i: token_label(model.tokenizer, i) for i in seen}  # every kept token was seen
    n_kept, n_seen = sum(kept.values()), sum(seen.values())
    top = kept.most_common(TOP)
    punctuation = [i for i in seen if (bare := label[i].strip(SPACE)) and all(c in string.punctuation for c in bare)]
    return {
        "ratio": model.config.ratio,
        "nuggets": n_kept,
        "tokens": n_seen,
        "top": [{"token": label[i], "nugget_share": c / n_kept, "text_share": seen[i] / n_seen} for i, c in top],
        "top10_coverage": sum(c for _, c in top) / n_kept,
        "text_top10_coverage": sum(c for _, c in seen.most_common(TOP)) / n_seen,
        "punctuation_share": sum(kept[i] for i in punctuation) / n_kept,
        "text_punctuation_share": sum(seen[i] for i in punctuation) / n_seen,
        "gap_mean": statistics.fmean(gaps) if gaps else None,
        "gap_stdev": statistics.pstdev(gaps) if gaps else None,
    }


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [*made_by(meta, f"{meta['torch_threads']} threads; torch {meta['torch']}; data: {results['data']} "
                      f"({results['documents']} documents, first {results['max_tokens']} tokens each)"), "",
             *table(["checkpoint", "r", "nuggets", "top-10 types cover (text)", "punctuation (text)",
                     "gap mean / stdev"],
                    ([name, f"{s['ratio']:g}", s["nuggets"], f"{s['top10_coverage']:.1%} ({s['text_top10_coverage']:.1%})",
                      f"{s['punctuation_share']:.1%} ({s['text_punctuation_share']:.1%})",
                      f"{s['gap_mean']:.1f} / {s['gap_stdev']:.1f}"] for name, s in results["checkpoints"].items()))]
    for name, s in results["checkpoints"].items():
        lines += ["", f"Most kept token types, {name} (share of nuggets / share of text):", ""]
        lines.append(", ".join(f"`{t['token']}` {t['nugget_share']:.1%} / {t['text_share']:.1%}" for t in s["top"]))
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Like the paper's Fig. 5: for each checkpoint, its most kept token types, nugget vs text frequency."""
    names = list(results["checkpoints"])
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        top = results["checkpoints"][name]["top"]
        x = range(len(top))
        ax.bar([i - 0.2 for i in x], [t["nugget_share"] for t in top], 0.4, label="nuggets")
        ax.bar([i + 0.2 for i in x], [t["text_share"] for t in top], 0.4, label="text")
        ax.set_xticks(list(x), [t["token"] for t in top])
        ax.set_ylabel("share")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", nargs="+", type=checkpoint_arg, default=[None, "default"],
                        help="checkpoint directories; 'default': the shipped one; 'none': untrained adapters")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/python-3.11-docs.jsonl"))
    parser.add_argument("--split", choices=["train", "dev", "test"], default="dev")
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512, help="keep the first N tokens of each document")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int)
    add_name_options(parser, "nugget-tokens")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    texts = [d["text"] for d in read_documents(args.data, args.split) if d["text"].strip()][: args.documents]
    results = {
        "meta": run_meta(command="python benchmarks/nugget_tokens.py " + shlex.join(sys.argv[1:]),
                         torch_threads=torch.get_num_threads(), torch=torch.__version__),
        "data": f"{args.data.name} ({args.split})", "documents": len(texts), "max_tokens": args.tokens,
        "checkpoints": {},
    }
    for checkpoint in args.checkpoints:
        model = NuggetModel.from_pretrained(checkpoint)
        model.eval()
        documents = [model.tokenizer(t, add_special_tokens=False)["input_ids"][: args.tokens] for t in texts]
        name = {None: "untrained", "default": "shipped (default)"}.get(checkpoint, str(checkpoint))
        results["checkpoints"][name] = selection_statistics(model, documents, args.batch_size)
        del model

    write_report(args.out_dir / args.name, results, markdown)
    plot(results, args.out_dir / f"{args.name}.png")
    print(f"wrote {args.out_dir / args.name}.json, .md, .png")

if __name__ == "__main__":
    main()

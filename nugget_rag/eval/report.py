"""Results as JSON, markdown tables and small PNG plots; optionally written into BENCHMARKS.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .tasks import HIGHER_IS_BETTER, MAIN_METRIC

BEGIN = "<!-- nugget-rag eval: begin -->"
END = "<!-- nugget-rag eval: end -->"


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _cell(row: dict, metric: str) -> str:
    if row.get("status") != "ok":
        return row.get("status", "-")
    if metric == "rougeL":  # summarisation: ROUGE-1 / ROUGE-2 / ROUGE-L
        text = "/".join(_fmt(row["metrics"].get(m)) for m in ("rouge1", "rouge2", "rougeL"))
    else:
        text = _fmt(row["metrics"].get(metric), 2 if metric == "perplexity" else 1)
    notes = []
    if row["scored"] < row["examples"]:
        notes.append(f"{row['examples'] - row['scored']} skipped")
    if row.get("empty_outputs"):
        notes.append(f"{row['empty_outputs']} empty")
    for key, value in (row.get("notes") or {}).items():
        notes.append(f"{value:g} {key.replace('_', ' ')}")
    return text + (f" ({', '.join(notes)})" if notes else "")


def markdown(results: dict) -> str:
    meta = results["meta"]
    commands = meta.get("commands") or ([meta["command"]] if meta.get("command") else [])
    lines = [f"- Date: {meta['date']}. Machine: {meta['machine']}. Model: {meta['model']}, adapters {meta['adapters']}."]
    if not commands:
        lines.append("- Command: (called from Python)")
    elif len(commands) == 1:
        lines.append(f"- Command: `{commands[0]}`")
    else:
        lines += ["- Commands (one report merged with `--resume`; all cells of a task share one setup):",
                  *(f"  - `{c}`" for c in commands)]
    lines.append("")
    for task, info in results["tasks"].items():
        ratios = task_ratios(results, task)
        metric = MAIN_METRIC[task]
        arrow = "higher is better" if HIGHER_IS_BETTER[metric] else "lower is better"
        skipped = ", ".join(f"{n} {reason}" for reason, n in info["skipped"].items()) or "none"
        shown = "ROUGE-1 / ROUGE-2 / ROUGE-L F1" if metric == "rougeL" else metric
        lines += [f"### {task}: {shown} ({arrow})", "",
                  (f"{info['examples']} examples from `{Path(info['source']).name}` (split {info['split']}); "
                  f"skipped before any system ran: {skipped}."), ""]
        header = "| system | uncompressed | " + " | ".join(f"r = {r:g}" for r in ratios) + " | achieved r |"
        lines += [header, "|" + "---|" * (len(ratios) + 3)]
        for name, sys_info in results["systems"].items():
            rows = [r for r in results["results"] if r["task"] == task and r["system"] == name]
            if not rows:
                continue
            label = sys_info["label"]
            if rows[0]["status"] != "ok":
                lines.append(f"| {label} | {rows[0]['status']}: {rows[0]['reason']} |" + " |" * (len(ratios) + 1))
                continue
            if not sys_info["uses_ratio"]:
                lines.append(f"| {label} | {_cell(rows[0], metric)} |" + " |" * len(ratios) + " 1 |")
                continue
            by_ratio = {r["ratio"]: r for r in rows}
            cells = [_cell(by_ratio[r], metric) if r in by_ratio else "-" for r in ratios]
            achieved = "/".join(_fmt(by_ratio[r].get("achieved_ratio")) for r in ratios if r in by_ratio)
            lines.append(f"| {label} | | " + " | ".join(cells) + f" | {achieved} |")
        if task == "autoencoding":
            lines += ["", *_bleu_by_length(results, ratios)]
        lines.append("")
    if "speed" in results:
        lines += _speed_table(results["speed"])
    if "optimal" in results:
        opt = results["optimal"]
        lines += ["### Scorer vs greedy-optimal selection (App. A)", "",
                  (f"{opt['examples']} examples, r = {opt['ratio']:g}: {opt['replaced_share'] * 100:.1f} % of the "
                  f"Scorer's nuggets replaced; perplexity {opt['ppl_scorer']:.2f} (Scorer) -> "
                  f"{opt['ppl_optimal']:.2f} (greedy-optimal)."), ""]
    described = [f"- **{i['label']}**: {i['description'].strip()}" for i in results["systems"].values() if i["description"]]
    if described and results["tasks"]:
        lines += ["Systems:", "", *described, ""]
    lines += [("Labels: *re-impl.* = a re-implementation of the peer's method in this harness (not the peer's code); "
              "*peer* = the peer's own package; *reference* = query-aware, cannot be cached across questions. "
              "Cells: the metric over the examples scored; skipped and empty outputs are counted in brackets "
              "(an empty output is scored as given: wrong, or 0). Achieved r = document tokens / kept slots. "
              "In the plots, nugget-rag is the thick black line; a dotted line marks a system whose achieved r "
              "is below 0.8 r."), ""]
    return "\n".join(lines)


def task_ratios(results: dict, task: str) -> list[float]:
    """The ratios that some system of `task` was run at (runs merged with --resume may differ per task)."""
    return sorted({r["ratio"] for r in results["results"] if r["task"] == task and r.get("ratio") is not None})


def _bleu_by_length(results: dict, ratios: list[float]) -> list[str]:
    rows = [r for r in results["results"] if r["task"] == "autoencoding" and r.get("status") == "ok"]
    lengths = sorted({int(k.split("@")[1]) for r in rows for k in r["metrics"] if k.startswith("bleu@")})
    if not lengths:
        return []
    out = ["BLEU by input length (tokens):", "", "| system | r | " + " | ".join(map(str, lengths)) + " |",
           "|" + "---|" * (len(lengths) + 2)]
    for r in rows:
        ratio = "1" if r["ratio"] is None else f"{r['ratio']:g}"
        out.append(f"| {r['label']} | {ratio} | " + " | ".join(_fmt(r["metrics"].get(f"bleu@{n}")) for n in lengths) + " |")
    return out


def _speed_seconds(speed: dict) -> str:
    """The run's setup seconds apart from its measured ones (runs before they were timed: none)."""
    setup = speed.get("setup_s")
    if setup is None:
        return ""
    model = f"loading the model {setup['model']} s, " if setup.get("model") is not None else ""
    return (f" Setup: {model}tokenising the documents {setup['documents']} s, warm-ups (compiling, recording CUDA "
            f"graphs) {setup['warmups']} s; measured {speed['measured_s']} s.")


def _speed_table(speed: dict) -> list[str]:
    where = (f"Measured on {speed['machine']}, {speed['date']}, by `{speed['command']}`. " if speed.get("command")
             else "")
    out = ["### Speed and memory" + ("" if where else " (same run)"), "",
           where + (f"Device {speed['device']}; documents of {speed['doc_tokens']} tokens; medians of {speed['repeats']} after a "
           f"warm-up; decode latency over {speed['decode_steps'] - 1} tokens.") + _speed_seconds(speed), "",
           ("| documents | r | nuggets | TTFT Full (s) | TTFT nuggets (s) | speed-up | decode Full (ms/tok) | "
           "decode nuggets (ms/tok) | KV docs Full / nuggets | compress (tok/s) | store hit mem / disk (ms) |"),
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in speed["rows"]:
        for ratio, e in row["nugget"].items():
            full_ttft = row.get("ttft_full_s")
            full_dec = row.get("decode_full_s_per_token")
            out.append(
                f"| {row['documents']} | {ratio} | {e['nuggets']} | {_fmt(full_ttft, 3)} | {e['ttft_s']:.3f} | "
                f"{_fmt(e.get('ttft_speedup'))}x | {_fmt(full_dec and full_dec * 1000)} | "
                f"{e['decode_s_per_token'] * 1000:.1f} | {e['kv_reduction_docs']:.1f}x | "
                f"{e['compress_tokens_per_s']:.0f} | {e['store_hit_memory_s'] * 1000:.2f} / "
                f"{e['store_hit_disk_s'] * 1000:.2f} |")
    adaptive = [row for row in speed["rows"] if "adaptive" in row]
    if adaptive:
        out += ["", "The default chain's resolution policy over stored states (its probe and the store reads "
                "included in TTFT):", "",
                "| documents | positions read | TTFT Full (s) | TTFT policy (s) | speed-up | decode policy (ms/tok) |",
                "|---|---|---|---|---|---|"]
        out += [f"| {row['documents']} | {row['adaptive']['positions']} | {_fmt(row.get('ttft_full_s'), 3)} | "
                f"{row['adaptive']['ttft_s']:.3f} | {_fmt(row['adaptive'].get('ttft_speedup'))}x | "
                f"{row['adaptive']['decode_s_per_token'] * 1000:.1f} |" for row in adaptive]
    sizes = [(row["documents"], ratio, e["stored_bytes_per_token"]) for row in speed["rows"]
             for ratio, e in row["nugget"].items() if "stored_bytes_per_token" in e]
    if sizes:
        formats = list(sizes[0][2])
        out += ["", "Stored bytes per document token (the whole serialised state, by key/value format; ratio to "
                "float32):", "", "| documents | r | " + " | ".join(formats) + " |", "|---|---|" + "---|" * len(formats)]
        out += [f"| {docs} | {ratio} | " + " | ".join(f"{b[f]:.0f} ({b[f] / b['float32']:.2f}x)" for f in formats) + " |"
                for docs, ratio, b in sizes]
    for row in speed["rows"]:
        if "full_skipped" in row:
            out.append(f"\nFull at {row['documents']} documents: not run, {row['full_skipped']} "
                       f"({row['full_prompt_tokens']} prompt tokens + {speed['decode_steps']} new).")
    for s in speed.get("skipped", []):
        out.append(f"\nSkipped {s['documents']} documents: {s['reason']}.")
    return out + [""]


# ------------------------------------------------------------------ plots
UNDER_BUDGET = 0.8  # achieved r below this fraction of the asked r: the plot marks the system


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def plots(results: dict, out_dir: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task in results["tasks"]:
        metric = MAIN_METRIC[task]
        ratios = task_ratios(results, task)
        rows = [r for r in results["results"] if r["task"] == task and r.get("status") == "ok"]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=100)
        colors = plt.get_cmap("tab20").colors
        for index, (name, info) in enumerate(results["systems"].items()):
            mine = [r for r in rows if r["system"] == name and metric in r["metrics"]]
            color = colors[index % len(colors)]
            if not mine:
                continue
            if info["uses_ratio"]:
                mine.sort(key=lambda r: r["ratio"])
                ours = name == "nugget"
                # a system that keeps far more than 1/r is drawn dotted: its points are not at the ratio on the axis
                short = any((r.get("achieved_ratio") or r["ratio"]) < UNDER_BUDGET * r["ratio"] for r in mine)
                label = info["label"] + (" [achieved r below r]" if short else "")
                ax.plot([r["ratio"] for r in mine], [r["metrics"][metric] for r in mine], marker="o",
                        color="black" if ours else color, linewidth=2.5 if ours else 1.5,
                        linestyle=":" if short else "-", label=label, zorder=3 if ours else 2)
            else:
                ax.axhline(mine[0]["metrics"][metric], linestyle="--", linewidth=1, color=color, label=info["label"])
        ax.set_xscale("log")
        ax.set_xticks(ratios, [f"{r:g}" for r in ratios])
        ax.minorticks_off()
        ax.set_xlabel("compression ratio r")
        ax.set_ylabel(metric)
        ax.set_title(f"{task}: {metric} vs r", fontsize=9)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        written.append(_save(fig, out_dir / f"{stem}-{task}-vs-r.png"))
    ae = [r for r in results["results"] if r["task"] == "autoencoding" and r.get("status") == "ok"]
    if ae:
        fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=100)
        colors = plt.get_cmap("tab20").colors
        for index, r in enumerate(ae):
            points = sorted((int(k.split("@")[1]), v) for k, v in r["metrics"].items() if k.startswith("bleu@"))
            ratio = "" if r["ratio"] is None else f" r={r['ratio']:g}"
            ax.plot([p for p, _ in points], [v for _, v in points], marker="o", label=r["label"] + ratio,
                    color=colors[index % len(colors)], linestyle="-" if index < len(colors) else ":")
        ax.set_xlabel("input length (tokens)")
        ax.set_ylabel("BLEU")
        ax.set_title("autoencoding: BLEU vs length (Fig. 4)", fontsize=9)
        ax.legend(fontsize=5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        written.append(_save(fig, out_dir / f"{stem}-bleu-vs-length.png"))
    speed = results.get("speed")
    if speed and speed["rows"]:
        fig, ax = plt.subplots(figsize=(5, 3.4), dpi=100)
        rows = speed["rows"]
        full = [(r["documents"], r["ttft_full_s"]) for r in rows if "ttft_full_s" in r]
        if full:
            ax.plot(*zip(*full), marker="o", label="Full")
        for ratio in rows[0]["nugget"]:
            ax.plot([r["documents"] for r in rows], [r["nugget"][ratio]["ttft_s"] for r in rows], marker="o",
                    label=f"nugget-rag r={ratio}")
        ax.set_xlabel("documents")
        ax.set_ylabel("time to first token (s)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"time to first token ({speed['device']})", fontsize=9)
        ax.legend(fontsize=6)
        written.append(_save(fig, out_dir / f"{stem}-ttft-vs-documents.png"))
    return written


def write_outputs(results: dict, cfg) -> dict:
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = cfg.name
    predictions = results.pop("predictions", [])
    files = {"json": str(out_dir / f"{stem}.json"), "markdown": str(out_dir / f"{stem}.md"),
             "predictions": str(out_dir / f"{stem}-predictions.jsonl")}
    files["plots"] = plots(results, out_dir, stem) if cfg.plots else []
    text = markdown(results)
    if files["plots"]:
        text += "\n" + "\n".join(f"![{Path(p).stem}]({_relative(p, out_dir)})" for p in files["plots"]) + "\n"
    Path(files["markdown"]).write_text(text)
    with open(files["predictions"], "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in predictions)
    results["files"] = files
    Path(files["json"]).write_text(json.dumps(results, indent=2, default=str))
    results["predictions"] = predictions
    if cfg.write_benchmarks is not None:
        update_benchmarks(Path(cfg.write_benchmarks), results, out_dir, stem)
    return files


def _relative(path: str, base: Path) -> str:
    return Path(path).name if Path(path).parent == base else path


def update_benchmarks(path: Path, results: dict, out_dir: Path, stem: str) -> None:
    """Put the run's markdown between the harness markers of `path` (appended when the markers are absent)."""
    body = markdown(results)
    for plot in results.get("files", {}).get("plots", []):
        try:
            rel = Path(plot).resolve().relative_to(path.resolve().parent)
        except ValueError:
            rel = Path(plot)
        body += f"\n![{Path(plot).stem}]({rel})"
    block = f"{BEGIN}\n## Evaluation harness results\n\n{body}\n\nRaw results: `{out_dir / (stem + '.json')}`.\n{END}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.DOTALL)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)

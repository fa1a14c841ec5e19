"""Which tokens became nuggets (like Fig. 7 of the Dodo paper): in the terminal or as a self-contained HTML page."""

from __future__ import annotations

import html
from dataclasses import dataclass

from langchain_core.documents import Document

from nugget_rag.components.compressor import METADATA_KEY, NuggetCompressor

REVERSE_GREEN = "\x1b[7;32m"
RESET = "\x1b[0m"


@dataclass
class NuggetView:
    """A text cut into its tokens' pieces (with their leading whitespace), their Scorer scores and the nuggets."""

    pieces: list[str]
    scores: list[float]
    nuggets: set[int]
    ratio: float

    @property
    def n(self) -> int:
        return len(self.pieces)

    @property
    def k(self) -> int:
        return len(self.nuggets)

    def summary(self) -> str:
        return f"{self.n} tokens, {self.k} nuggets, r = {self.n / max(self.k, 1):.2f} (target r = {self.ratio:g})"


def nugget_view(compressor: NuggetCompressor, text: str, ratio: float | None = None) -> NuggetView:
    """Score every token of `text` as `NuggetModel.compress` does and mark those the compressor keeps as nuggets at
    `ratio` (default: the compressor's).

    Like compress, long texts are cut into segments of at most the model's positions less the document opening,
    each scored after that opening in one batch, so the scores shown are those the nuggets were chosen by.
    """
    model = compressor.model
    ids, pieces, nuggets = _kept(compressor, text, ratio)
    segment = model.segment_length(compressor.segment_tokens)
    segments = [ids[start : start + segment] for start in range(0, len(ids), segment)]
    input_ids, opening = model.encoder_input(segments)
    rows = model.score(input_ids)[:, opening:].float().cpu().tolist()
    scores = [score for row, part in zip(rows, segments) for score in row[: len(part)]]
    return NuggetView(pieces, scores, nuggets, ratio or compressor.effective_ratio)


def reading_view(compressor: NuggetCompressor, document: Document, reading: dict) -> dict:
    """One retrieved passage as the page at / shows it: its reading (an entry of NuggetLLM's
    ``response_metadata["resolution"]``), its metadata, its tokens' pieces and the positions of its nuggets at
    `nugget_ratio`: those the answer read, for a passage read as nuggets; else those the store keeps at the
    compressor's ratio (what a skim reads)."""
    ratio = reading["ratio"] if reading["read_as"] == "nuggets" else compressor.effective_ratio
    _, pieces, nuggets = _kept(compressor, document.page_content, ratio)
    return {**reading, "metadata": {k: v for k, v in document.metadata.items() if k != METADATA_KEY},
            "tokens": pieces, "nuggets": sorted(nuggets), "nugget_ratio": ratio}


def _kept(compressor: NuggetCompressor, text: str, ratio: float | None) -> tuple[list[int], list[str], set[int]]:
    """The token ids of `text`, their pieces and the positions of the nuggets kept at `ratio` (from the store)."""
    if not text.strip():
        raise ValueError("the text to inspect is empty")
    tokenizer = compressor.model.tokenizer
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
    ids = encoded["input_ids"]
    state = compressor.states([Document(page_content=text)], ratio)[0]
    return ids, _pieces(text, ids, encoded.get("offset_mapping"), tokenizer), set(state.positions.tolist())


def _pieces(text: str, ids: list[int], offsets: list[tuple[int, int]] | None, tokenizer) -> list[str]:
    """Each token's text; with offsets, the pieces (each taking the whitespace before it) rebuild `text` exactly."""
    if not offsets:
        return [tokenizer.decode([i]) for i in ids]
    pieces, done = [], 0
    for i, (_, end) in enumerate(offsets):
        end = len(text) if i == len(offsets) - 1 else max(end, done)
        pieces.append(text[done:end])
        done = end
    return pieces


def render_terminal(view: NuggetView, color: bool = True) -> str:
    """The text with nugget tokens in reverse green (or [[bracketed]] without colour), then the summary line."""
    out = []
    for i, piece in enumerate(view.pieces):
        if i not in view.nuggets:
            out.append(piece)
            continue
        body = piece.lstrip() or piece  # highlight the token, not the whitespace before it
        lead = piece[: len(piece) - len(body)]
        out.append(lead + (f"{REVERSE_GREEN}{body}{RESET}" if color else f"[[{body}]]"))
    return "".join(out).rstrip("\n") + "\n\n" + view.summary()


def score_levels(scores: list[float]) -> list[float]:
    """Each score's rank among all of them, scaled to 0..1: one outlier (the first token's score is often far
    below the rest) cannot squash the shading of every other token."""
    order = sorted(range(len(scores)), key=scores.__getitem__)
    levels = [0.0] * len(scores)
    for rank, i in enumerate(order):
        levels[i] = rank / max(len(scores) - 1, 1)
    return levels


def _shade(level: float, nugget: bool) -> str:
    """Light backgrounds under dark text at every level: green for nuggets, blue for the rest."""
    return f"hsl(130,55%,{82 - 30 * level:.0f}%)" if nugget else f"hsl(215,70%,{98 - 26 * level:.0f}%)"


def render_html(view: NuggetView, title: str = "nugget-rag: nuggets") -> str:
    """A self-contained page: every token shaded by its score's rank (darker = higher), nuggets in green and bold,
    its score on hover, and a legend with the score at the 5th, 50th and 95th percentiles."""
    levels = score_levels(view.scores)
    spans = []
    for i, (piece, score, level) in enumerate(zip(view.pieces, view.scores, levels)):
        cls = "tok nugget" if i in view.nuggets else "tok"
        spans.append(f'<span class="{cls}" style="background:{_shade(level, i in view.nuggets)}" '
                     f'title="token {i}: score {score:.4f} (rank {level:.0%})">{html.escape(piece)}</span>')
    ranked = sorted(view.scores)
    marks = " &nbsp; ".join(f"{q}th percentile: {ranked[round(q / 100 * (len(ranked) - 1))]:.2f}"
                            for q in (5, 50, 95)) if ranked else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 60em; color: #111; background: #fff; }}
.text {{ font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.8; }}
.tok {{ border-radius: 2px; }}
.nugget {{ font-weight: 700; outline: 1px solid hsl(130,55%,35%); }}
.legend {{ display: flex; gap: 1.5em; align-items: center; flex-wrap: wrap; font-size: .9em; }}
.bar {{ display: inline-block; width: 10em; height: 1em; vertical-align: middle; border: 1px solid #999; }}
</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="summary">{html.escape(view.summary())}</p>
<div class="legend">
<span><span class="nugget" style="background:{_shade(0.5, True)}">nugget</span> kept token</span>
<span>Scorer score rank: low <span class="bar" style="background:linear-gradient(to right,{_shade(0, False)},\
{_shade(1, False)})"></span> high</span>
<span>{marks}</span>
<span>(hover a token for its score)</span>
</div>
<div class="text">{"".join(spans)}</div>
</body></html>
"""

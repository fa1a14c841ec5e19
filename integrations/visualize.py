"""Which tokens became nuggets (like Fig. 7 of the Dodo paper): in the terminal or as a self-contained HTML page."""

from __future__ import annotations

import html
from dataclasses import dataclass

from langchain_core.documents import Document

from nugget_rag.compressor import NuggetCompressor

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


def nugget_view(compressor: NuggetCompressor, text: str) -> NuggetView:
    """Score every token of `text` as `NuggetModel.compress` does and mark those the compressor keeps as nuggets.

    Like compress, long texts are cut into segments of at most the model's positions less the document opening,
    each scored after that opening in one batch, so the scores shown are those the nuggets were chosen by.
    """
    if not text.strip():
        raise ValueError("the text to inspect is empty")
    model, tokenizer = compressor.model, compressor.model.tokenizer
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
    ids = encoded["input_ids"]
    state = compressor.states([Document(page_content=text)])[0]
    segment = model.segment_length(compressor.segment_tokens)
    segments = [ids[start : start + segment] for start in range(0, len(ids), segment)]
    input_ids, opening = model.encoder_input(segments)
    with model.lock:
        rows = model.score(input_ids)[:, opening:].float().cpu().tolist()
    scores = [score for row, part in zip(rows, segments) for score in row[: len(part)]]
    return NuggetView(_pieces(text, ids, encoded.get("offset_mapping"), tokenizer), scores,
                      set(state.positions.tolist()), compressor.effective_ratio)


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


def render_html(view: NuggetView, title: str = "nugget-rag: nuggets") -> str:
    """A self-contained page: every token a span darkened by its score; nuggets on a green background."""
    low, high = (min(view.scores), max(view.scores)) if view.scores else (0.0, 1.0)
    span = (high - low) or 1.0
    spans = []
    for i, (piece, score) in enumerate(zip(view.pieces, view.scores)):
        level = (score - low) / span
        if i in view.nuggets:
            style = f"background:hsl(120,65%,{78 - 40 * level:.0f}%)"
            cls = "tok nugget"
        else:
            style = f"background:rgba(0,0,0,{0.04 + 0.5 * level:.3f})"
            cls = "tok"
        if level > 0.7:
            style += ";color:#fff"
        spans.append(f'<span class="{cls}" style="{style}" title="token {i}: score {score:.4f}">'
                     f"{html.escape(piece)}</span>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 60em; }}
.text {{ font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.7; }}
.tok {{ border-radius: 2px; }}
.nugget {{ outline: 1px solid #2a7; }}
.legend span {{ padding: 0 .4em; }}
</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="summary">{html.escape(view.summary())}</p>
<p class="legend"><span style="background:hsl(120,65%,58%)">nugget</span>
<span style="background:rgba(0,0,0,.3)">darker = higher Scorer score</span>
(hover a token for its score)</p>
<div class="text">{"".join(spans)}</div>
</body></html>
"""

"""GET /: the page to ask questions on (page.html), its choice of readings filled in."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from ...components.resolution import RESOLUTIONS

router = APIRouter()
PAGE = Path(__file__).parents[1] / "page.html"


@cache
def page_html() -> str:
    return PAGE.read_text(encoding="utf-8").replace(
        "__RESOLUTIONS__", "".join(f'<option value="{name}">{name}</option>' for name in RESOLUTIONS))


@router.get("/", response_class=HTMLResponse)
def page() -> str:
    return page_html()

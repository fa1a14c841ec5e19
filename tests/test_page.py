"""The page at GET / of `nugget-rag serve`: what /ask gives it, its API key, and the page itself in headless Chromium
(Debian's chromium driven by Playwright; skipped, saying why, where either is missing)."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra")
from fastapi.testclient import TestClient  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from test_integrations import HashEmbeddings  # noqa: E402
from test_server import KEY, UNAUTHORIZED, basic, slow_steps  # noqa: E402, F401
from tiny import tiny_nugget_model  # noqa: E402

from nugget_rag import NuggetCompressor, NuggetStore  # noqa: E402
from nugget_rag.integrations import NuggetIndex, nugget_view  # noqa: E402
from nugget_rag.resolution import RESOLUTIONS  # noqa: E402
from nugget_rag.serving import create_app, serve_in_thread  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PASSAGES = ["The falcon hunts over the river valley and dives at great speed to catch smaller birds.",
            "Sourdough bread needs flour, water, salt and a starter culture kept alive for days.",
            "Falcons nest on cliffs; a falcon pair returns to the same river cliff every spring.",
            "The river valley floods in spring, when snow melts on the mountains above it."]
QUESTION = "Where do falcons hunt?"


@pytest.fixture
def index(tmp_path):
    model = tiny_nugget_model()
    compressor = NuggetCompressor(model=model, store=NuggetStore(directory=tmp_path / "nuggets"))
    index = NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=128, chunk_overlap=0)
    index.ingest([Document(page_content=text, metadata={"source": f"notes-{i}.txt"})
                  for i, text in enumerate(PASSAGES)])
    return index


def test_ask_returns_the_passages_only_when_asked(index):
    compressor = index.compressor
    with TestClient(create_app(index, None)) as client:
        plain = client.post("/ask", json={"question": QUESTION, "k": 3, "max_new_tokens": 4, "stream": False})
        assert plain.status_code == 200 and "passages" not in plain.json()
        for resolution, stream in [("default", False), ("uniform", True)]:
            body = {"question": QUESTION, "k": 3, "max_new_tokens": 4, "stream": stream, "passages": True,
                    "resolution": resolution}
            response = client.post("/ask", json=body)
            last = json.loads(response.text.splitlines()[-1]) if stream else response.json()
            passages = last["passages"]
            assert [p["index"] for p in passages] == [0, 1, 2]
            for passage in passages:
                text = "".join(passage["tokens"])
                assert text in PASSAGES and passage["metadata"]["source"] == f"notes-{PASSAGES.index(text)}.txt"
                view = nugget_view(compressor, text, passage["nugget_ratio"])
                assert passage["nuggets"] == sorted(view.nuggets) and 0 < len(view.nuggets) < len(text)
                assert isinstance(passage["relevance"], float) and passage["reason"].startswith("rank ")
            readings = [(p["read_as"], p["ratio"], p["nugget_ratio"]) for p in passages]
            if resolution == "uniform":  # every passage read as its nuggets at the compressor's ratio
                assert readings == [("nuggets", 4.0, 4.0)] * 3
            else:  # the likeliest read whole as text, others dropped: the nuggets shown are the store's at r = 4
                assert ("text", 1.0, 4.0) in readings and set(readings) <= {("text", 1.0, 4.0), (None, None, 4.0)}


def test_the_page_needs_the_key_and_refuses_like_the_api(index):
    with TestClient(create_app(index, None, api_key=KEY)) as client:
        page = client.get("/", headers={"Authorization": basic("reader", KEY)})
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert all(f'<option value="{name}">{name}</option>' in page.text for name in RESOLUTIONS)
        assert "__RESOLUTIONS__" not in page.text
        refused, api = client.get("/"), client.post("/ask", json={"question": QUESTION})
        assert refused.status_code == api.status_code == 401 and refused.json() == api.json() == UNAUTHORIZED
        assert refused.headers.get_list("www-authenticate") == api.headers.get_list("www-authenticate")


@pytest.fixture
def chromium():
    """A headless Chromium, without downloads: Debian's, driven by Playwright."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def ask_on(page) -> None:
    page.fill("#question", QUESTION)
    page.fill("#k", "3")
    page.fill("#max-new-tokens", "24")
    page.click("#send")


@pytest.mark.usefixtures("slow_steps")  # decoding at 20 ms a step: the answer streams for a while
def test_the_page_streams_the_answer_and_shows_each_passage(index, chromium, tmp_path):
    with serve_in_thread(create_app(index, None, api_key=KEY)) as url:
        asked = {"question": QUESTION, "k": 3, "max_new_tokens": 24, "stream": False, "passages": True}
        request = urllib.request.Request(f"{url}/ask", json.dumps(asked).encode(), method="POST", headers={
            "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request) as response:
            expected = json.load(response)

        page = chromium.new_context(http_credentials={"username": "reader", "password": KEY}).new_page()
        assert page.goto(f"{url}/").status == 200
        page.wait_for_function("document.getElementById('served').textContent.includes('4 chunks')")
        ask_on(page)
        # the answer shows piece by piece: some of it is there before the passages, which come with the last line
        page.wait_for_function("document.getElementById('answer').textContent.length > 0 "
                               "&& !document.querySelector('.passage')")
        page.wait_for_selector(".passage")
        assert page.text_content("#answer") == expected["answer"]

        rows = page.locator(".passage")
        assert rows.count() == len(expected["passages"]) == 3
        for i, passage in enumerate(expected["passages"]):
            row = rows.nth(i)
            kind = "dropped" if passage["ratio"] is None else "whole" if passage["ratio"] == 1 else "skimmed"
            assert row.get_attribute("data-reading") == kind
            assert row.locator(".relevance").text_content() == f"relevance {passage['relevance']:.2f}"
            assert row.locator(".tokens").text_content() == "".join(passage["tokens"])
            marks = row.locator("mark.nugget")
            assert marks.count() == len(passage["nuggets"]) > 0
            assert marks.first.text_content() == passage["tokens"][passage["nuggets"][0]].lstrip()
        assert page.locator("#error").is_hidden()
        screenshot = tmp_path / "page.png"
        page.screenshot(path=screenshot, full_page=True)
        print(f"the page: {screenshot}")

        # a browser not handed the credentials, given them in the address: it keeps them for the page's requests
        visitor = chromium.new_context().new_page()
        assert visitor.goto(url.replace("http://", f"http://reader:{KEY}@") + "/").status == 200
        ask_on(visitor)
        visitor.wait_for_selector(".passage, #error[style*='block']")
        assert visitor.locator("#error").is_hidden(), visitor.text_content("#error")
        assert visitor.text_content("#answer") == expected["answer"]

        # the page's address fetched without credentials (nor the browser's cached ones): the API's 401
        status, body = page.evaluate("fetch('/', {credentials: 'omit'}).then(async r => [r.status, await r.text()])")
        assert status == 401 and json.loads(body) == UNAUTHORIZED

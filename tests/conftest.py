import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import perturb_adapters as perturb  # noqa: E402
from tiny import tiny_base  # noqa: E402

from nugget_rag.config import NuggetConfig  # noqa: E402
from nugget_rag.model import NuggetModel  # noqa: E402


@pytest.fixture
def make_model():
    """A NuggetModel on a fresh tiny LLaMA; LoRA B matrices are randomised so adapters change outputs."""

    def make(ratio: float = 4.0, perturb_adapters: bool = True, **config) -> NuggetModel:
        model = NuggetModel(tiny_base(), NuggetConfig(ratio=ratio, scorer_layer=2, lora={"rank": 4}, **config))
        return perturb(model) if perturb_adapters else model

    return make


@pytest.fixture
def doc_ids(make_model):
    def ids(text: str) -> list[int]:
        from tiny import tiny_tokenizer

        return tiny_tokenizer()(text)["input_ids"]

    return ids


WORDS = "the cat sat on a mat while dogs ran far away into green hills under blue skies".split()


@pytest.fixture
def data(tmp_path):
    """A folder of small training files: docs.jsonl (text), squad.json (SQuAD format), summ.jsonl (CNN/DM fields)."""
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 30))) for _ in range(40)]
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    squad = {"data": [{"title": str(i), "paragraphs": [{"context": t, "qas": [
        {"id": str(i), "question": "Which word comes first?", "answers": [{"text": t.split()[0]}]}]}]}
        for i, t in enumerate(texts)]}
    (folder / "squad.json").write_text(json.dumps(squad))
    (folder / "summ.jsonl").write_text(
        "".join(json.dumps({"article": t, "highlights": " ".join(t.split()[:3])}) + "\n" for t in texts))
    # rag.json: two articles of five paragraphs, a question each whose answer is the paragraph's first word
    rag = {"data": [{"title": f"a{a}", "paragraphs": [{"context": texts[5 * a + p], "qas": [
        {"id": f"{a}-{p}", "question": f"Which word comes first in {' '.join(texts[5 * a + p].split()[1:4])}?",
         "answers": [{"text": texts[5 * a + p].split()[0]}]}]} for p in range(5)]} for a in range(2)]}
    (folder / "rag.json").write_text(json.dumps(rag))
    return folder


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A Redis server shared by a module's tests (a module that wants one per test defines its own)."""
    from redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def tiny_model():
    """The usual tiny NuggetModel (tiny.tiny_nugget_model), one a module."""
    from tiny import tiny_nugget_model

    return tiny_nugget_model()


@pytest.fixture
def compressor(tiny_model, tmp_path):
    """A NuggetCompressor of `tiny_model` over a store in the test's folder (modules with other needs define theirs)."""
    from nugget_rag import NuggetCompressor, NuggetStore

    return NuggetCompressor(model=tiny_model, store=NuggetStore(directory=tmp_path / "store"))


@pytest.fixture
def tiny_cli(tiny_model, tmp_path, monkeypatch):
    """The CLI loading `tiny_model` and HashEmbeddings; returns a folder holding test_integrations.DOCS as files."""
    from test_integrations import DOCS, HashEmbeddings

    from nugget_rag import NuggetCompressor, NuggetStore, cli

    def load_compressor(args, store_dir=None):
        return NuggetCompressor(model=tiny_model, store=NuggetStore(directory=store_dir), ratio=args.ratio)

    monkeypatch.setattr(cli.loading, "load_compressor", load_compressor)
    monkeypatch.setattr(cli.loading, "load_embeddings", lambda args: HashEmbeddings())
    docs = tmp_path / "docs"
    docs.mkdir()
    for doc in DOCS:
        (docs / doc.metadata["source"]).write_text(doc.page_content)
    return docs


def pytest_terminal_summary(terminalreporter):
    """Each vector-database case by name and outcome (store and test), as LangChain's standard suites list them,
    also under `pytest -q`."""
    reports = [r for outcome in ("passed", "failed", "error", "skipped") for r in terminalreporter.stats.get(outcome, [])
               if "test_vector_databases.py" in getattr(r, "nodeid", "")]
    if reports:
        terminalreporter.section("vector databases, each case")
        for report in sorted(reports, key=lambda r: r.nodeid):
            reason = f" ({report.longrepr[2]})" if report.skipped and isinstance(report.longrepr, tuple) else ""
            terminalreporter.write_line(f"{report.outcome.upper()} {report.nodeid}{reason}")

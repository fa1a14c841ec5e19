"""scripts/build_corpus.py: extraction, chunking, splitting, dedup, the test-overlap filter, pinned digests and the
splits.json it writes (no network, no apt: a fake .deb built with dpkg-deb, a character-level tokenizer)."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import tiny_tokenizer

from nugget_rag import corpora
from nugget_rag.train.records import load_records
from nugget_rag.train.sources import Source

SCRIPT = Path(__file__).parent.parent / "scripts" / "build_corpus.py"
needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb is not installed")

PROSE = ("The scheduler picks the next task to run from the queue of runnable tasks, and it gives each one a "
         "time slice whose length depends on its priority and on how long it has already waited. ")
SIDEBAR = '<div class="sphinxsidebar"><h3>Navigation</h3><a href="a.html">Next topic</a></div>'
NAVBAR = '<div class="related"><a href="p.html">Previous</a> | <a href="n.html">Next</a></div>'


def page(body: str, title: str = "Tasks") -> str:
    return (f"<html><head><title>{title}</title><script>var x = 1;</script></head><body>{NAVBAR}"
            f'<div role="main" class="body"><h1>{title}<a class="headerlink" href="#t">¶</a></h1>{body}</div>'
            f"{SIDEBAR}<footer>© 2024 Someone. Built with Sphinx.</footer></body></html>")


@pytest.fixture(scope="module")
def bc():
    spec = importlib.util.spec_from_file_location("build_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_corpus"] = module  # dataclasses and the worker processes look it up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules["build_corpus"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A fast character-level tokenizer on disk: one token a character."""
    path = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer().save_pretrained(path)
    return path


# ------------------------------------------------------------------ extraction
def test_page_text_keeps_the_main_text_and_drops_navigation(bc):
    html = page(f"<p>{PROSE}</p><p>Second paragraph.</p><pre><code>for t in tasks:\n    run(t)</code></pre>")
    text, why = bc.page_text(html.encode())
    assert why == ""
    assert text.split("\n\n") == ["Tasks", PROSE.strip(), "Second paragraph.", "for t in tasks:\n    run(t)"]
    for boilerplate in ("Next", "Previous", "Navigation", "¶", "var x", "Built with Sphinx"):
        assert boilerplate not in text


def test_empty_and_link_only_pages_are_skipped_with_the_reason(bc):
    assert bc.page_text(page("<p>Short.</p>").encode()) == ("", "empty")
    assert bc.page_text(b"") == ("", "empty")
    links = "".join(f'<li><a href="p{i}.html">Chapter {i}: about the subject of part {i}</a></li>' for i in range(30))
    assert bc.page_text(page(f"<ul>{links}</ul>").encode()) == ("", "navigation")


# ------------------------------------------------------------------ chunking
def test_chunks_end_at_paragraph_boundaries_and_fit(bc, tokenizer_dir):
    from transformers import AutoTokenizer

    chunker = bc.Chunker(AutoTokenizer.from_pretrained(tokenizer_dir), min_tokens=20, max_tokens=300)
    paragraphs = [f"Paragraph {i}. " + PROSE[: 40 + 17 * i] for i in range(8)]
    units, short = chunker("\n\n".join(paragraphs))
    assert len(units) > 1 and short == 0
    assert [p for text, _ in units for p in text.split("\n\n")] == paragraphs  # whole paragraphs, in order
    assert all(n == len(text) <= 300 for text, n in units)  # one token a character
    long_line = "x" * 700
    assert [n for _, n in chunker(long_line)[0]] == [300, 300, 100]
    assert chunker("tiny") == ([], 4)  # too short to keep: counted


def test_chunk_packs_evenly(bc):
    assert bc.chunk(["a", "b", "c"], [1000, 100, 1000], 2000) == ["a\n\nb", "c"]
    assert bc.chunk(["a", "b", "c"], [1040, 1040, 20], 2000) == ["a", "b\n\nc"]


# ------------------------------------------------------------------ split, dedup, overlap
def test_document_split_is_a_fixed_function_of_the_id(bc):
    ids = [f"pkg:usr/share/doc/pkg/page{i}.html" for i in range(20000)]
    splits = [bc.split_of(i) for i in ids]
    assert splits == [bc.split_of(i) for i in ids]
    for name, share in (("test", 0.01), ("dev", 0.01), ("train", 0.98)):
        assert splits.count(name) / len(ids) == pytest.approx(share, rel=0.15)


def unit(bc, i: int, text: str, split: str = "train"):
    return bc.Unit(f"pkg:p{i}.html#0", text, len(text), "pkg", split)


def test_exact_duplicates_are_dropped_keeping_the_first(bc, monkeypatch):
    monkeypatch.setattr(bc, "_test_ngrams", frozenset())
    units = [unit(bc, 0, "Alpha beta.\n\nGamma", "test"), unit(bc, 1, "alpha   BETA. gamma"), unit(bc, 2, "Delta")]
    kept, dropped = bc.filter_units(units, workers=1)
    assert [u.id for u in kept] == ["pkg:p0.html#0", "pkg:p2.html#0"]
    assert [u.id for u in dropped["duplicate"]] == ["pkg:p1.html#0"] and dropped["test_overlap"] == []


def test_units_sharing_a_13_gram_with_a_test_part_are_dropped(bc, monkeypatch):
    test_text = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen."
    monkeypatch.setattr(bc, "_test_ngrams", frozenset(bc.ngrams(test_text)))
    shares_13 = unit(bc, 0, "Before. ONE two three four five six seven eight nine ten eleven twelve, thirteen after")
    shares_12 = unit(bc, 1, "one two three four five six seven eight nine ten eleven twelve zero thirteen")
    kept, dropped = bc.filter_units([shares_13, shares_12], workers=1)
    assert [u.id for u in kept] == [shares_12.id]
    assert dropped == {"duplicate": [], "test_overlap": [shares_13]}


def test_test_documents_come_first_so_train_never_repeats_them(bc):
    pages = [{"id": f"pkg:p{i}.html", "units": [[f"text {i}", 10]]} for i in range(400)]
    extracted = [bc.Extracted(bc.DebSource("pkg", "1", "0" * 64, ("x",)), {}, pages)]
    order = [u.split for u in bc.units_in_order(extracted)]
    assert order == sorted(order, key=["test", "dev", "train"].index) and set(order) == {"test", "dev", "train"}


# ------------------------------------------------------------------ the written corpus
def test_splits_json_makes_each_file_read_as_exactly_its_split(bc, tmp_path):
    units = [unit(bc, i, f"Train unit {i}.") for i in range(7)]
    units += [unit(bc, 10 + i, f"Dev unit {i}.", "dev") for i in range(3)]
    units += [unit(bc, 20 + i, f"Test unit {i}.", "test") for i in range(2)]
    files = bc.write_corpus(units, tmp_path, shard_tokens=40)
    assert files["train"] == ["train-000.jsonl", "train-001.jsonl"]  # 4 units of 13 tokens reach 40, 3 follow
    expected = {"train": [u for u in units if u.split == "train"], "dev": units[7:10], "test": units[10:]}
    for split, names in files.items():
        lines = []
        for name in names:
            path = tmp_path / name
            lines += [json.loads(line)["text"] for line in path.read_text().splitlines()]
            read = load_records(Source(objective="autoencoding", path=str(path)), split)
            assert read["text"] == [json.loads(line)["text"] for line in path.read_text().splitlines()]
            assert corpora.read_documents(path, split) == [json.loads(line) for line in path.read_text().splitlines()]
        assert lines == [u.text for u in expected[split]]
    shard = tmp_path / "train-000.jsonl"
    assert corpora.read_documents(shard, "dev") == []
    for path, split in ((shard, "test"), (tmp_path / "dev.jsonl", "train"), (tmp_path / "dev.jsonl", "test"),
                        (tmp_path / "test.jsonl", "train"), (tmp_path / "test.jsonl", "dev")):
        with pytest.raises(corpora.DataError):
            corpora.read_documents(path, split)
        with pytest.raises(corpora.DataError):
            load_records(Source(objective="autoencoding", path=str(path)), split)


# ------------------------------------------------------------------ sources and the whole build
def fake_deb(root: Path, package: str, pages: dict[str, str]) -> Path:
    """A .deb named as apt names it, holding HTML pages and a DEP-5 copyright file."""
    tree = root / "tree"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(f"Package: {package}\nVersion: 1.0-1\nArchitecture: all\n"
                                             "Maintainer: A <a@example.org>\nDescription: test pages\n")
    doc = tree / "usr/share/doc" / package
    (doc / "html").mkdir(parents=True)
    (doc / "copyright").write_text("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\n"
                                   "Files: *\nCopyright: 2024 A\nLicense: GPL-2+\n\nFiles: html/x.js\n"
                                   "Copyright: 2024 B\nLicense: MIT\n")
    for name, html in pages.items():
        (doc / "html" / name).write_text(html)
    deb = root / "debs" / f"{package}_1.0-1_all.deb"
    deb.parent.mkdir(parents=True)
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(tree), str(deb)], check=True,
                   capture_output=True)
    return deb


def fake_test_data(root: Path, squad_test_context: str) -> Path:
    """A ../shared/data stand-in: each benchmark's file with a test part, and its splits.json."""
    root.mkdir()
    article = {"paragraphs": [{"context": squad_test_context, "qas": [{"question": "Who?", "answers": [{"text": "A"}]}]}]}
    (root / "squad-dev-v1.1.json").write_text(json.dumps({"data": [article, article]}))
    (root / "cnndm-test-250.jsonl").write_text(json.dumps({"article": "News.", "highlights": "News."}) + "\n")
    (root / "hotpotqa-dev-distractor-53.json").write_text(json.dumps(
        [{"question": "Q?", "answer": "A", "context": [["T", ["Sentence one. ", "Sentence two."]]]}]))
    (root / "python-3.11-docs.jsonl").write_text(json.dumps({"id": "a.rst", "text": "Python text."}) + "\n")
    (root / "splits.json").write_text(json.dumps({
        "squad-dev-v1.1.json": {"train": [0, 1], "test": [1, 2]}, "cnndm-test-250.jsonl": {"test": [0, 1]},
        "hotpotqa-dev-distractor-53.json": {"test": "all"}, "python-3.11-docs.jsonl": {"test": "all"}}))
    return root


@pytest.fixture
def fake_source(bc, tmp_path, monkeypatch):
    leak = "the eviction thread wakes every second and frees pages that nobody has touched since its last visit"
    pages = {
        "sched.html": page(f"<p>{PROSE}</p>" * 3),
        "copy.html": page(f"<p>{PROSE}</p>" * 3),  # the same text under another name
        "mm.html": page(f"<p>{PROSE.replace('task', 'page')}</p><p>Also, {leak}.</p>", "Memory"),
        "stub.html": page("<p>See elsewhere.</p>"),
        "genindex.html": page(f"<p>{PROSE}</p>", "Index"),
    }
    deb = fake_deb(tmp_path / "work", "fake-doc", pages)
    source = bc.DebSource("fake-doc", "1.0-1", bc.sha256_file(deb), ("usr/share/doc/fake-doc/html",), bc.SPHINX)
    monkeypatch.setitem(bc.SOURCES, "fake-doc", source)
    return source, fake_test_data(tmp_path / "data", f"Unrelated start; {leak}.")


@needs_dpkg
def test_a_changed_digest_stops_the_build_naming_package_and_digests(bc, fake_source, tmp_path):
    source, _ = fake_source
    wrong = bc.DebSource(source.package, source.version, "f" * 64, source.roots)
    with pytest.raises(bc.SourceError) as err:
        bc.deb_path(wrong, tmp_path / "work")
    assert "fake-doc" in str(err.value) and "f" * 64 in str(err.value) and source.sha256 in str(err.value)


def test_a_package_apt_cannot_find_is_named(bc, tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 100, "", "E: Unable to locate package no-such-doc")
    monkeypatch.setattr(bc.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(bc.SourceError, match="no-such-doc=1.0.*Unable to locate package"):
        bc.deb_path(bc.DebSource("no-such-doc", "1.0", "0" * 64, ("x",)), tmp_path)


@needs_dpkg
def test_the_build_writes_a_checked_corpus_and_its_manifest(bc, fake_source, tokenizer_dir, tmp_path, monkeypatch):
    source, data = fake_source
    monkeypatch.setattr(bc, "convert_default_model", lambda: tokenizer_dir)
    out = tmp_path / "out"
    argv = [str(out), "--sources", "fake-doc", "--work-dir", str(tmp_path / "work"), "--test-data", str(data),
            "--min-tokens", "100", "--max-tokens", "1000", "--workers", "1"]
    assert bc.main(argv) == 3  # far fewer than 50M train tokens: an error without --allow-short
    assert bc.main([*argv, "--allow-short"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    [entry] = manifest["sources"]
    assert (entry["package"], entry["version"], entry["sha256"]) == ("fake-doc", "1.0-1", source.sha256)
    assert entry["licence"]["main"] == "GPL-2+" and entry["licence"]["all"] == ["GPL-2+", "MIT"]
    assert entry["files"] == 4 and entry["files_skipped_empty"] == 1  # genindex.html is not read at all
    assert manifest["dropped"]["test_overlap"]["units"] == entry["test_overlap_units"] == 1  # mm.html: SQuAD's test
    assert manifest["dropped"]["duplicate"]["units"] == entry["duplicate_units"] == 1  # copy.html repeats sched.html
    texts = [json.loads(line)["text"] for f in out.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert len(texts) == sum(s["units"] for s in manifest["splits"].values()) == 1
    assert texts[0].startswith("Tasks\n\nThe scheduler picks")

    wrong = bc.DebSource(source.package, source.version, "0" * 64, source.roots, source.skip)
    monkeypatch.setitem(bc.SOURCES, "fake-doc", wrong)
    assert bc.main([*argv, "--allow-short"]) == 2  # the digest changed: the build stops
    assert bc.main([*argv, "--allow-short", "--skip-bad-sources"]) == 0  # or skips it, and says so
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["package"] for s in manifest["skipped_sources"]] == ["fake-doc"] and manifest["sources"] == []


def test_pages_of_a_test_part_are_left_out(bc, tmp_path):
    data = fake_test_data(tmp_path / "data", "Some context.")  # its python-3.11-docs test part: a.rst
    source = bc.DebSource("py-doc", "1", "0" * 64, ("usr/share/doc/py/html",), test_part="python-3.11-docs.jsonl")
    pages = [{"id": f"py-doc:usr/share/doc/py/html/{name}.html", "units": [["text", 4]]} for name in ("a", "b")]
    extracted = [bc.Extracted(source, {}, pages)]
    bc.drop_test_documents(extracted, data)
    assert [p["id"] for p in extracted[0].pages] == ["py-doc:usr/share/doc/py/html/b.html"]
    assert extracted[0].stats["documents_in_a_test_part"] == 1

"""Build a pretraining corpus of English technical prose (>= 50M tokens) from pinned Debian documentation packages.

    python scripts/build_corpus.py OUT [--sources linux-doc-6.1 ...] [--work-dir DIR] [--test-data ../shared/data]

Gives, in OUT: `train-000.jsonl`, `train-001.jsonl`, ... (shards of about 5M tokens), `dev.jsonl` and `test.jsonl`,
JSONL lines ``{"id", "text"}``, each a unit of 128-2000 tokens of the default model's tokenizer (a page's text cut at
paragraph boundaries); `splits.json`, by which `nugget_rag.corpora` (and `load_records`) reads each file as exactly
its split; and `manifest.json`: each source's package, version, SHA-256 and licence, tokens/units/documents per split
and per source, what was dropped (empty or navigation pages, duplicates, units sharing a 13-gram with a test part of
../shared/data) and the wall time. The 24 pinned packages (`SOURCES`, Debian 12) give about 69M train tokens; a clean
build takes about 15 minutes on 2 cores, a rerun on its work dir half a minute.

Steps, each cached under the work dir (default OUT/.work) so that a rerun skips what is done: download each pinned
package (`apt-get download NAME=VERSION`; its SHA-256 must match the pin), unpack it (`dpkg-deb -x`), extract and chunk
its HTML pages (2 processes), then leave out the pages of a test part (python3.11-doc's pages of the python-3.11-docs
test documents), split by page (a hash of its id: 98/1/1), drop duplicate units (test and dev first, so that train
never repeats them) and units that share a lower-cased word 13-gram with a test part of ../shared/data, and write.
A package apt cannot find or whose digest changed stops the build with exit status 2 (`--skip-bad-sources` skips it,
loudly); fewer than 50M train tokens is exit status 3 unless `--allow-short`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the worker processes are the parallelism

import lxml.html
from inscriptis import Inscriptis
from inscriptis.css_profiles import CSS_PROFILES
from inscriptis.model.config import ParserConfig
from tqdm import tqdm

from nugget_rag.model.base_model import DEFAULT_MODEL_NAME, convert_default_model
from nugget_rag.state.files import sha256_file

log = logging.getLogger("build_corpus")

MIN_TRAIN_TOKENS = 50_000_000
SHARD_TOKENS = 5_000_000
SPLIT_SHARES = {"test": 1, "dev": 1}  # percent of pages; the rest is train
NGRAM = 13
REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ sources
@dataclass(frozen=True)
class DebSource:
    """A Debian documentation package pinned by name, version and the SHA-256 of its .deb; `roots`: the folders in
    it whose HTML pages are read; `skip`: patterns (of paths below a root) of index, search and listing pages;
    `test_part`: a file of ../shared/data whose test part holds some of its pages (as .rst sources, by path below
    the first root), which are left out."""

    package: str
    version: str
    sha256: str
    roots: tuple[str, ...]
    skip: tuple[str, ...] = ()
    test_part: str = ""


SPHINX = ("*genindex*.html", "*search.html", "*modindex.html", "*_sources/*", "*_static/*", "*_images/*",
          "*_modules/*", "*_downloads/*")  # index, search and source-listing pages of Sphinx
SOURCES = {s.package: s for s in [  # about 75M tokens in all
    DebSource("linux-doc-6.1", "6.1.176-1",
              "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f",
              ("usr/share/doc/linux-doc-6.1/html",), SPHINX + ("translations/*",)),
    DebSource("sagemath-doc", "9.5-6",
              "dae42f803878fe655dd4627b3ddaa74de82a737a6076527d3441e80018ab2b12",
              ("usr/share/doc/sagemath/html/en",), SPHINX),
    DebSource("lilypond-doc-html", "2.24.1-2",
              "be9fb743e58bd5ad4710146fe05e7c5f447fe4559e42c6acef1916d53e4bec60",
              ("usr/share/doc/lilypond/html",), ("*-big-page.html",)),
    DebSource("openjdk-17-doc", "17.0.19+10-1~deb12u2",
              "e94dbb2d3663db00888536aba970489ebec932058eba02f038587cbc805e0007",
              ("usr/share/doc/openjdk-17-jre-headless/api", "usr/share/doc/openjdk-17-jre-headless/specs"),
              ("*/class-use/*", "index-files/*", "*-tree.html", "*package-use.html", "all*-index.html",
               "*-list.html", "help-doc.html", "search.html", "serialized-form.html", "constant-values.html")),
    DebSource("qtbase5-doc-html", "5.15.8+dfsg-11+deb12u3",
              "e052497a7db970f002807e3543043c11e46135641b8284b0a419086ba64f5f47",
              ("usr/share/qt5/doc",), ("*-members.html", "*-module.html", "*-obsolete.html")),
    DebSource("cppreference-doc-en-html", "20170409-2",
              "603e9b7ef33d08b957e287b2b1f429f2338bccf75144f91b7c9e51d3cb6a14e2",
              ("usr/share/cppreference/doc/html/en",), ("*symbol_index*",)),
    DebSource("python3.11-doc", "3.11.2-6+deb12u8",
              "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
              ("usr/share/doc/python3.11/html",), SPHINX, "python-3.11-docs.jsonl"),
    DebSource("python-scipy-doc", "1.10.1-2",
              "a237fdcef1675622f1a5d8a291c64feba140615130ee625554f94772d4ea3ad7",
              ("usr/share/doc/python-scipy-doc/html",), SPHINX),
    DebSource("python-pandas-doc", "1.5.3+dfsg-2",
              "4998405ff6b12432f46594963e95554ade1104705795428396345fca58d853f8",
              ("usr/share/doc/python-pandas-doc/html",), SPHINX),
    DebSource("python-statsmodels-doc", "0.13.5+dfsg-7",
              "4167a3e13347343b9f0a6677fc804ecad80dd735d17bc051829610f6f1bc2afb",
              ("usr/share/doc/python-statsmodels-doc/html",), SPHINX),
    DebSource("llvm-15-doc", "1:15.0.6-4",
              "613d2f6c303411508b28775269d4f6c35498905d0f3e2dd39f862191a1faf564",
              ("usr/share/doc/llvm-15-doc/html",), SPHINX),
    DebSource("racket-doc", "8.7+dfsg1-1",
              "d50139b4bf806cd280bd18146ca2e7579cede5da23cc7f5c663044596af4e00f",
              ("usr/share/doc/racket",), ("*doc-index.html", "search/*")),
    DebSource("erlang-doc", "1:25.2.3+dfsg-1+deb12u4",
              "7d172cecfdd9c2930b27c776ad226ffcc84670375cf830c79ee41c6944e8a1c8",
              ("usr/share/doc/erlang-doc",), ("*/index.html", "*/search.html")),
    DebSource("rust-doc", "1.63.0+dfsg1-2",
              "96ef96fe6df87d939ca713bd7df3d15c2b778ccb892eca025c4ee504146f697b",
              ("usr/share/doc/rust-doc/html",),
              ("src/*", "core/*", "alloc/*", "*/arch/*", "implementors/*", "*/print.html", "*/all.html",
               "settings.html", "help.html", "*/toc.html")),
    DebSource("libboost1.81-doc", "1.81.0-5+deb12u1",
              "da1e2182ea8955cf6155924066dd611588f855aebf961d0ea0e7ac0092216ebb",
              ("usr/share/doc/libboost1.81-doc",), ("*/index.html",)),
    DebSource("postgresql-doc-15", "15.18-0+deb12u1",
              "3c598277a463c44d672daa2c335deb8d8252e1852fb025fd4578ea2d9a1b90f0",
              ("usr/share/doc/postgresql-doc-15/html",), ("bookindex.html", "index.html")),
    DebSource("sqlite3-doc", "3.40.1-2+deb12u2",
              "466e30d7066e2641fa13e56bc662a2ad521b8cc9c17dde9c9dac3d4f105e32f2",
              ("usr/share/doc/sqlite3",), ("*/index.html", "sitemap.html", "keyword_index.html")),
    DebSource("python-sklearn-doc", "1.2.1+dfsg-1",
              "4e244556326064e87e7563e3e544c2288d44b5719db2d7b3a85c9a84ae93488d",
              ("usr/share/doc/python-sklearn-doc/html",), SPHINX),
    DebSource("python-sqlalchemy-doc", "1.4.46+ds1-1",
              "8805c3167ef75278ac6fd58ed9856321c2b2e3a7e441edba84b2eb955216d0fd",
              ("usr/share/doc/python-sqlalchemy-doc/html",), SPHINX),
    DebSource("python-django-doc", "3:3.2.25-0+deb12u3",
              "33319c8e45b95693603213442ccf9bcee933ef338488115203ad25a0e01c696f",
              ("usr/share/doc/python-django-doc/html",), SPHINX),
    DebSource("nodejs-doc", "18.20.4+dfsg-1~deb12u2",
              "9f674d3536be94923bb8720c48ec17bc92b8de62f2954c3172b59a3ada1de65f",
              ("usr/share/doc/nodejs/api",), ("all.html", "index.html")),
    DebSource("python-sympy-doc", "1.11.1-1",
              "2a1d50bd49738f0280308fc8d86d5fa5739dbc6391e1c754f4549bc3635e6a31",
              ("usr/share/doc/python-sympy-doc/html",), SPHINX),
    DebSource("python-astropy-doc", "5.2.1-2+deb12u1",
              "d7cfa77ec5239a4ebcdf27c7cdc3d9e604228e99257f91d4260abbb970469b91",
              ("usr/share/doc/python-astropy-doc/html",), SPHINX),
    DebSource("debian-reference-en", "2.100",
              "9f31d3a17df505de09689ca255512ea58c1fc47c59bb1b0c7bf1c23362e9743f",
              ("usr/share/debian-reference",), ("index.*.html",)),
]}


class SourceError(RuntimeError):
    """A pinned source that cannot be used as pinned: apt cannot find it, or its .deb's digest changed."""


def deb_path(source: DebSource, work: Path) -> Path:
    """The pinned .deb in the work dir, downloaded once with apt-get and checked against its pinned SHA-256."""
    debs = work / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    pattern = f"{source.package}_{source.version.replace(':', '%3a')}_*.deb"  # apt's name for it
    found = sorted(debs.glob(pattern))
    if not found:
        spec = f"{source.package}={source.version}"
        run = subprocess.run(["apt-get", "download", spec], cwd=debs, capture_output=True, text=True)
        found = sorted(debs.glob(pattern))
        if run.returncode != 0 or not found:
            raise SourceError(f"apt-get download {spec} failed: {run.stderr.strip() or run.stdout.strip()} "
                              f"(check `apt-cache policy {source.package}`; pin a version this release has)")
    check_sha256(source, found[0])
    return found[0]


def check_sha256(source: DebSource, path: Path) -> None:
    """Raise SourceError naming the package, the pinned and the actual digest when `path` is not the pinned .deb."""
    actual = sha256_file(path)
    if actual != source.sha256:
        raise SourceError(f"{source.package} {source.version}: SHA-256 of {path.name} is {actual}, the pin expects "
                          f"{source.sha256}; the package changed: review it and update the pin")


def unpack(source: DebSource, deb: Path, work: Path) -> Path:
    """The .deb's files, unpacked once with dpkg-deb."""
    target = work / "unpacked" / source.package
    done = target / ".unpacked"
    if not done.is_file():
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(target)], check=True)
        done.write_text(deb.name)
    return target


def licence(root: Path, package: str) -> dict:
    """The licence of a package's files as its /usr/share/doc/PKG/copyright gives it: for a machine-readable (DEP-5)
    file, `main`, the licence of `Files: *`, and `all`, every licence it names; else the file's opening lines."""
    path = root / "usr/share/doc" / package / "copyright"
    if not path.is_file():
        raise SourceError(f"{package} has no /usr/share/doc/{package}/copyright; its licence is unknown")
    text = path.read_text(encoding="utf-8", errors="replace")
    where = f"/usr/share/doc/{package}/copyright"
    if not text.startswith("Format:"):
        return {"main": "not machine-readable: see the copyright file", "all": [], "copyright": where,
                "opening": " ".join(text[:600].split())}
    main, names = None, []
    for stanza in text.split("\n\n"):
        fields = dict(line.split(":", 1) for line in stanza.splitlines() if ":" in line and not line[:1].isspace())
        name = fields.get("License", "").strip()
        if name and name not in names:
            names.append(name)
        if name and main is None and "*" in fields.get("Files", "").split():
            main = name
    return {"main": main or names[0], "all": names, "copyright": where}


def pages(source: DebSource, root: Path) -> list[tuple[str, Path]]:
    """(page id, file) of the source's HTML pages: regular files (no symlinks) below its roots, minus its skips."""
    found = []
    for top in source.roots:
        base = root / top
        if not base.is_dir():
            raise SourceError(f"{source.package} {source.version} has no folder /{top}")
        for folder, _, names in os.walk(base):
            for name in names:
                path = Path(folder, name)
                rel = path.relative_to(base).as_posix()
                if (name.endswith((".html", ".htm")) and not path.is_symlink()
                        and not any(fnmatch(rel, p) for p in source.skip)):
                    found.append((f"{source.package}:{path.relative_to(root).as_posix()}", path))
    return sorted(found)


# ------------------------------------------------------------------ extraction
MAIN = ['//*[@role="main"]', "//main", '//*[@id="mw-content-text"]', '//*[@id="main-content"]',
        '//div[contains(concat(" ", @class, " "), " mainContent ")]', '//div[@class="main"]', '//*[@id="content"]',
        "//body"]
BOILERPLATE_TAGS = ("script", "style", "nav", "header", "footer", "noscript", "form", "button", "iframe")
BOILERPLATE_CLASSES = (  # Sphinx, DocBook, javadoc, rustdoc, MediaWiki (cppreference), Qt, Boost, Erlang, Racket,
    # Texinfo (LilyPond)
    "headerlink", "sphinxsidebar", "related", "navheader", "navfooter", "spirit-nav", "copyright-footer",
    "summary", "inherited-list", "sub-nav", "t-navbar", "editsection", "printfooter", "catlinks", "toc",
    "sidebar", "navigationbar", "footer", "srclink", "src", "out-of-band", "anchor", "title-anchors", "topbar",
    "leftnav-tube", "prev-next", "footer-links", "tocset", "navsettop", "navsetbottom",
    "nav_table", "footer_report", "footer_version", "toc_uplink")
BOILERPLATE_IDS = ("trait-implementations-list", "blanket-implementations-list", "synthetic-implementations-list",
                   "toc", "catlinks", "siteSub", "contentSub", "jump-to-nav", "rustdoc-vars", "settings-menu",
                   "sidebar", "navbar-top", "navbar-bottom", "footer", "highlighting-settings", "tocframe")
BOILERPLATE = " | ".join(
    [f".//{t}" for t in BOILERPLATE_TAGS]
    + [f'.//*[contains(concat(" ", normalize-space(@class), " "), " {c} ")]' for c in BOILERPLATE_CLASSES]
    + [f'.//*[@id="{i}"]' for i in BOILERPLATE_IDS])
LAYOUT = ParserConfig(css=CSS_PROFILES["strict"], display_links=False, display_anchors=False)
CONTROL_CHARACTERS = dict.fromkeys(c for c in range(32) if chr(c) not in "\t\n\r")  # not allowed in XML text
MIN_PAGE_CHARS = 200  # a page whose text is shorter is counted as empty
MAX_LINK_SHARE = 0.7  # a page whose text is mostly link text is navigation (a table of contents, an index)


def page_text(html: bytes) -> tuple[str, str]:
    """(text, '') of a page's main content, or ('', why) for a page that is empty or navigation.

    lxml selects the main content and drops navigation by tag, class and id; inscriptis lays the rest out as text
    (paragraphs, lists, tables and code kept in reading order) — a maintained HTML-to-text renderer, unlike a bare
    get_text(), which runs blocks together."""
    try:
        tree = lxml.html.fromstring(html)
    except (lxml.etree.ParserError, ValueError):
        return "", "empty"
    main = next((found[0] for xpath in MAIN if (found := tree.xpath(xpath))), tree)
    for node in main.xpath(BOILERPLATE):
        node.drop_tree()
    for pre in main.iter("pre"):  # inscriptis keeps a <pre>'s line breaks, but not those of a <code> in it
        code = pre.text_content().translate(CONTROL_CHARACTERS)
        pre.clear(keep_tail=True)
        pre.text = code
    everything = len(main.text_content().split())
    linked = sum(len(a.text_content().split()) for a in main.iter("a"))
    text = tidy(Inscriptis(main, LAYOUT).get_text())
    if len(text) < MIN_PAGE_CHARS:
        return "", "empty"
    if linked > MAX_LINK_SHARE * everything:
        return "", "navigation"
    return text, ""


def tidy(text: str) -> str:
    """Lines right-stripped and dedented, runs of blank lines cut to one (a paragraph break)."""
    lines = textwrap.dedent("\n".join(line.rstrip() for line in text.splitlines())).splitlines()
    return "\n\n".join("\n".join(p) for p in paragraphs_of(lines))


def paragraphs_of(lines: Iterable[str]) -> Iterator[list[str]]:
    """Groups of non-blank lines, split at blank lines."""
    group: list[str] = []
    for line in lines:
        if line.strip():
            group.append(line)
        elif group:
            yield group
            group = []
    if group:
        yield group


# ------------------------------------------------------------------ chunking
def chunk(paragraphs: list[str], lengths: list[int], max_tokens: int) -> list[str]:
    """Paragraphs packed in order into units of at most `max_tokens` (a paragraph's `lengths` plus one for the break),
    as even as the paragraph boundaries allow; a paragraph longer than that is a unit of its own (see `split_long`)."""
    total = sum(n + 1 for n in lengths)
    target = total / max(1, -(-total // max_tokens))  # the even share of ceil(total / max_tokens) units
    units, current, size = [], [], 0
    for text, n in zip(paragraphs, lengths):
        if current and (size + n + 1 > max_tokens or size >= target):
            units.append("\n\n".join(current))
            current, size = [], 0
        current.append(text)
        size += n + 1
    if current:
        units.append("\n\n".join(current))
    return units


class Chunker:
    """Cuts a page's text into units of `min_tokens`..`max_tokens` tokens at paragraph boundaries (then line
    boundaries, then token boundaries for a line longer than a unit); returns (text, tokens) pairs."""

    def __init__(self, tokenizer, min_tokens: int, max_tokens: int):
        self.tok, self.min_tokens, self.max_tokens = tokenizer, min_tokens, max_tokens

    def count(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]] if texts else []

    def __call__(self, text: str) -> tuple[list[tuple[str, int]], int]:
        """(units, tokens in units too short to keep)."""
        pieces = [piece for p in text.split("\n\n") for piece in self.split_long(p)]
        units = chunk(pieces, self.count(pieces), self.max_tokens)
        kept = list(zip(units, self.count(units)))
        return [u for u in kept if u[1] >= self.min_tokens], sum(n for _, n in kept if n < self.min_tokens)

    def split_long(self, paragraph: str) -> list[str]:
        """The paragraph, or for one over `max_tokens` its lines packed into pieces that fit."""
        [n] = self.count([paragraph])
        if n <= self.max_tokens:
            return [paragraph]
        lines = [piece for line in paragraph.split("\n") for piece in self.split_line(line)]
        return [u.replace("\n\n", "\n") for u in chunk(lines, self.count(lines), self.max_tokens)]

    def split_line(self, line: str) -> list[str]:
        """The line, or for one over `max_tokens` its pieces of `max_tokens` tokens, cut at token boundaries."""
        enc = self.tok(line, add_special_tokens=False, return_offsets_mapping=True)
        starts = [start for start, _ in enc["offset_mapping"][::self.max_tokens]]
        return [line[a:b] for a, b in zip(starts, starts[1:] + [len(line)])]


_chunker: Chunker | None = None


def _init_worker(tokenizer_dir: str, min_tokens: int, max_tokens: int) -> None:
    from transformers import AutoTokenizer

    global _chunker
    _chunker = Chunker(AutoTokenizer.from_pretrained(tokenizer_dir), min_tokens, max_tokens)


def _extract(item: tuple[str, Path]) -> dict:
    """One page -> {"id", "units": [[text, tokens], ...], "skip": '' | 'empty' | 'navigation' | 'short' | 'error',
    "short": tokens in units too short to keep}."""
    page_id, path = item
    try:
        text, why = page_text(path.read_bytes())
    except (ValueError, lxml.etree.LxmlError) as err:  # a page lxml cannot hold: counted and named, not fatal
        return {"id": page_id, "units": [], "skip": "error", "short": 0, "error": f"{type(err).__name__}: {err}"}
    units, short = _chunker(text) if text else ([], 0)
    return {"id": page_id, "units": units, "skip": why or ("" if units else "short"), "short": short}


# ------------------------------------------------------------------ per-source cache
@dataclass
class Extracted:
    """A source's pages, chunked, and its counts."""

    source: DebSource
    licence: dict
    pages: list[dict]
    stats: dict = field(default_factory=dict)


def extract_source(source: DebSource, work: Path, settings: dict, workers: int) -> Extracted:
    """Download, check, unpack, extract and chunk one source; the result is cached in the work dir per settings."""
    deb = deb_path(source, work)
    root = unpack(source, deb, work)
    lic = licence(root, source.package)
    cache = work / "extracted" / f"{source.package}.jsonl"
    meta = cache.with_suffix(".json")
    key = {"package": source.package, "version": source.version, "sha256": source.sha256, **settings}
    if meta.is_file() and json.loads(meta.read_text()).get("key") == key:
        log.info("%s: extracted pages cached in %s", source.package, cache)
        stats = json.loads(meta.read_text())["stats"]
        return Extracted(source, lic, [json.loads(line) for line in cache.open(encoding="utf-8")], stats)
    items = pages(source, root)
    if not items:
        raise SourceError(f"{source.package} {source.version} holds no HTML pages below {source.roots}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    found = []
    stats = Counter(dict.fromkeys(["files_skipped_empty", "files_skipped_navigation", "files_skipped_short",
                                   "files_skipped_error", "short_unit_tokens"], 0), files=len(items))
    start = time.time()
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(workers, _init_worker, (settings["tokenizer"], settings["min_tokens"], settings["max_tokens"])) as pool:
        for page in tqdm(pool.imap(_extract, items, chunksize=16), total=len(items), desc=source.package,
                         unit="page", mininterval=5):
            if page["skip"]:
                stats[f"files_skipped_{page['skip']}"] += 1
            if page["skip"] == "error":
                log.warning("%s: skipped, %s", page["id"], page.pop("error"))
            stats["short_unit_tokens"] += page.pop("short")
            if page["units"]:
                found.append(page)
    if not found:
        raise SourceError(f"{source.package} {source.version}: all {len(items)} pages extract to nothing")
    stats["extract_s"] = round(time.time() - start)
    tmp = cache.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for page in found:
            f.write(json.dumps(page, ensure_ascii=False) + "\n")
    tmp.replace(cache)
    meta.write_text(json.dumps({"key": key, "stats": dict(stats)}, indent=1))
    log.info("%s: %d pages -> %d documents (%s)", source.package, len(items), len(found), dict(stats))
    return Extracted(source, lic, found, dict(stats))


# ------------------------------------------------------------------ splitting, dedup, overlap
def drop_test_documents(extracted: list[Extracted], data_dir: Path) -> None:
    """Leave out the pages whose sources are documents of a test part (`DebSource.test_part`), counted per source."""
    from nugget_rag import corpora

    for e in extracted:
        if not e.source.test_part:
            continue
        held = {r["id"] for r in corpora.read_documents(data_dir / e.source.test_part, "test")}
        prefix = f"{e.source.package}:{e.source.roots[0]}/"
        kept = [p for p in e.pages if p["id"].removeprefix(prefix).removesuffix(".html") + ".rst" not in held]
        if len(kept) == len(e.pages):
            raise SourceError(f"none of the {len(held)} test documents of {e.source.test_part} matched a page of "
                              f"{e.source.package}: the page paths no longer map to their .rst sources")
        e.stats["documents_in_a_test_part"] = len(e.pages) - len(kept)
        e.pages = kept


def split_of(doc_id: str) -> str:
    """The split of a document, fixed by the SHA-256 of its id: 1% test, 1% dev, the rest train."""
    bucket = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big") % 100
    edge = 0
    for name, share in SPLIT_SHARES.items():
        edge += share
        if bucket < edge:
            return name
    return "train"


def normalised_hash(text: str) -> bytes:
    """A digest of the text lower-cased with its whitespace collapsed (exact duplicates up to case and layout)."""
    return hashlib.blake2b(" ".join(text.lower().split()).encode(), digest_size=16).digest()


WORD = re.compile(r"\w+")


def ngrams(text: str, n: int = NGRAM) -> Iterator[tuple[str, ...]]:
    """The lower-cased word n-grams of a text."""
    words = WORD.findall(text.lower())
    return zip(*(words[i:] for i in range(n)))


def benchmark_test_texts(data_dir: Path) -> dict[str, list[str]]:
    """The texts of every test part of ../shared/data, read by nugget_rag.corpora by its splits.json."""
    from nugget_rag import corpora

    files = {"squad": "squad-dev-v1.1.json", "cnndm": "cnndm-test-250.jsonl",
             "hotpotqa": "hotpotqa-dev-distractor-53.json", "python-docs": "python-3.11-docs.jsonl"}
    missing = [name for name in files.values() if not (data_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"test data {missing} not found in {data_dir}: the test-overlap check needs them "
                                "(set --test-data)")
    squad = corpora.read_squad(data_dir / files["squad"], "test")
    cnndm = corpora.read_summarization(data_dir / files["cnndm"], "test")
    hotpot = corpora.read_hotpotqa(data_dir / files["hotpotqa"], "test")
    return {
        "squad": sorted({r["context"] for r in squad}) + [r["question"] for r in squad],
        "cnndm": [t for r in cnndm for t in (r["document"], r["summary"])],
        "hotpotqa": sorted({d for r in hotpot for d in r["documents"]}) + [r["question"] for r in hotpot],
        "python-docs": [r["text"] for r in corpora.read_documents(data_dir / files["python-docs"], "test")],
    }


_test_ngrams: frozenset = frozenset()


def overlaps(text: str) -> bool:
    """Whether a text shares a word 13-gram with a test part (`_test_ngrams`, set before the workers fork)."""
    return not _test_ngrams.isdisjoint(ngrams(text))


@dataclass
class Unit:
    """A training unit and where it came from."""

    id: str
    text: str
    tokens: int
    source: str
    split: str


def units_in_order(extracted: list[Extracted]) -> list[Unit]:
    """Every unit, test documents first, then dev, then train, each part in the order of its documents' id hashes
    (a fixed shuffle that mixes the sources); a document's units stay together and in order."""
    docs = [(split_of(p["id"]), hashlib.sha256(p["id"].encode()).hexdigest(), e.source.package, p)
            for e in extracted for p in e.pages]
    order = {"test": 0, "dev": 1, "train": 2}
    docs.sort(key=lambda d: (order[d[0]], d[1]))
    return [Unit(f"{page['id']}#{k}", text, tokens, package, split)
            for split, _, package, page in docs for k, (text, tokens) in enumerate(page["units"])]


def filter_units(units: list[Unit], workers: int) -> tuple[list[Unit], dict[str, list[Unit]]]:
    """Units without exact duplicates (the first kept) and without test overlap, and the dropped ones by reason."""
    seen: set[bytes] = set()
    fresh, duplicates = [], []
    for unit in units:
        digest = normalised_hash(unit.text)
        (duplicates if digest in seen else fresh).append(unit)
        seen.add(digest)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        flags = list(tqdm(pool.imap(overlaps, (u.text for u in fresh), chunksize=256), total=len(fresh),
                          desc="test overlap", unit="unit", mininterval=5))
    kept = [u for u, hit in zip(fresh, flags) if not hit]
    return kept, {"duplicate": duplicates, "test_overlap": [u for u, hit in zip(fresh, flags) if hit]}


# ------------------------------------------------------------------ writing
def splits_table(files: dict[str, list[str]]) -> dict:
    """splits.json: each train shard all train (an empty dev range, so that no dev part is carved from it), dev.jsonl
    all dev and test.jsonl all test; a part a file does not name is refused by nugget_rag.corpora."""
    table = {name: {"unit": "line index", "train": "all", "dev": [0, 0]} for name in files["train"]}
    table |= {name: {"unit": "line index", split: "all"} for split in ("dev", "test") for name in files[split]}
    return table


def write_corpus(units: list[Unit], out: Path, shard_tokens: int) -> dict[str, list[str]]:
    """train-NNN.jsonl shards of about `shard_tokens`, dev.jsonl, test.jsonl and splits.json; the files per split."""
    files: dict[str, list[str]] = {"train": [], "dev": ["dev.jsonl"], "test": ["test.jsonl"]}
    handles = {s: (out / f"{s}.jsonl").open("w", encoding="utf-8") for s in ("dev", "test")}
    shard, shard_size = None, 0
    for unit in units:
        if unit.split == "train" and (shard is None or shard_size >= shard_tokens):
            if shard is not None:
                shard.close()
            files["train"].append(f"train-{len(files['train']):03d}.jsonl")
            shard, shard_size = (out / files["train"][-1]).open("w", encoding="utf-8"), 0
        handle = shard if unit.split == "train" else handles[unit.split]
        handle.write(json.dumps({"id": unit.id, "text": unit.text}, ensure_ascii=False) + "\n")
        shard_size += unit.tokens if unit.split == "train" else 0
    for handle in [*handles.values(), *([shard] if shard else [])]:
        handle.close()
    (out / "splits.json").write_text(json.dumps(splits_table(files), indent=1))
    return files


def manifest(extracted: list[Extracted], units: list[Unit], dropped: dict[str, list[Unit]], files: dict,
             skipped: list[dict],
             settings: dict, test_ngrams: dict[str, int], wall_s: float) -> dict:
    """What the corpus holds and how it was made."""
    per_split = {s: {"tokens": 0, "units": 0, "documents": 0, "files": files[s]} for s in ("train", "dev", "test")}
    per_source = {e.source.package: {"package": e.source.package, "version": e.source.version,
                                     "sha256": e.source.sha256, "licence": e.licence, **e.stats,
                                     **{f"{reason}_units": 0 for reason in dropped},
                                     "documents": 0, "units": 0, "tokens": 0} for e in extracted}
    for reason, lost in dropped.items():
        for unit in lost:
            per_source[unit.source][f"{reason}_units"] += 1
    docs = set()
    for unit in units:
        doc = unit.id.rsplit("#", 1)[0]
        for entry in (per_split[unit.split], per_source[unit.source]):
            entry["tokens"] += unit.tokens
            entry["units"] += 1
            entry["documents"] += doc not in docs
        docs.add(doc)
    return {
        "splits": per_split,
        "sources": list(per_source.values()),
        "skipped_sources": skipped,
        "dropped": {reason: {"units": len(lost), "tokens": sum(u.tokens for u in lost)}
                    for reason, lost in dropped.items()},
        "test_overlap_check": {"ngram": NGRAM, "words": "lower-cased \\w+ runs", "test_ngrams": test_ngrams},
        "split_rule": "by document (page): sha256(id) % 100: 0 test, 1 dev, else train",
        "dedup": "exact, of units lower-cased with whitespace collapsed; test, then dev, then train keep the first",
        "tokenizer": {"name": DEFAULT_MODEL_NAME, "path": settings["tokenizer"], "class": "fast (tokenizers)"},
        "unit_tokens": {"min": settings["min_tokens"], "max": settings["max_tokens"]},
        "wall_time_s": round(wall_s, 1),
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
    }


# ------------------------------------------------------------------ main
def fast_tokenizer_dir() -> str:
    """The default model's directory, whose tokenizer must be a fast (Rust) one: it counts 70M tokens."""
    from transformers import AutoTokenizer

    path = convert_default_model()
    if not AutoTokenizer.from_pretrained(path).is_fast:
        raise RuntimeError(f"{path} has no fast tokenizer (tokenizer.json)")
    return str(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES), metavar="PACKAGE",
                        help=f"pinned packages to use (default: all: {', '.join(SOURCES)})")
    parser.add_argument("--work-dir", type=Path, help="cache of downloads and extractions (default OUT/.work)")
    parser.add_argument("--test-data", type=Path, default=REPO.parent / "shared" / "data",
                        help="../shared/data, whose test parts must not overlap the corpus")
    parser.add_argument("--min-tokens", type=int, default=128, help="shortest unit kept")
    parser.add_argument("--max-tokens", type=int, default=2000, help="longest unit")
    parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help="tokens per train shard")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-bad-sources", action="store_true",
                        help="skip (loudly) a source apt cannot find or whose digest changed, instead of stopping")
    parser.add_argument("--allow-short", action="store_true", help=f"accept < {MIN_TRAIN_TOKENS:,} train tokens")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    start = time.time()
    work = args.work_dir or args.out / ".work"
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"tokenizer": fast_tokenizer_dir(), "min_tokens": args.min_tokens, "max_tokens": args.max_tokens,
                "extractor": "lxml+inscriptis v2"}
    global _test_ngrams
    parts = benchmark_test_texts(args.test_data)
    counts = {name: len(set(g for t in texts for g in ngrams(t))) for name, texts in parts.items()}
    _test_ngrams = frozenset(g for texts in parts.values() for t in texts for g in ngrams(t))
    extracted, skipped = [], []
    for name in args.sources:
        try:
            extracted.append(extract_source(SOURCES[name], work, settings, args.workers))
        except SourceError as err:
            if not args.skip_bad_sources:
                log.error("%s; stopping (--skip-bad-sources would skip it)", err)
                return 2
            log.error("SKIPPING SOURCE %s: %s", name, err)
            skipped.append({"package": name, "reason": str(err)})
    drop_test_documents(extracted, args.test_data)
    units, dropped = filter_units(units_in_order(extracted), args.workers)
    files = write_corpus(units, args.out, args.shard_tokens)
    info = manifest(extracted, units, dropped, files, skipped, settings, counts, time.time() - start)
    (args.out / "manifest.json").write_text(json.dumps(info, indent=1))
    train = info["splits"]["train"]["tokens"]
    log.info("wrote %s: %s", args.out, {s: (v["tokens"], v["units"]) for s, v in info["splits"].items()})
    if train < MIN_TRAIN_TOKENS:
        log.error("ONLY %s TRAIN TOKENS, fewer than the %s asked for%s", f"{train:,}", f"{MIN_TRAIN_TOKENS:,}",
                  " (accepted: --allow-short)" if args.allow_short else "; add sources (or --allow-short)")
        return 0 if args.allow_short else 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bad input tried at scale (hypothesis): arbitrary HTTP bodies, NuggetState bytes, published records and segments,
and texts to chunk get a 4xx or a named error, never a 500, a hang or a changed store; a secret in a URL is never
printed. Example counts are kept
modest (EXAMPLES) so that the suite stays fast; each suite's count is its `max_examples`."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from langchain_core.documents import Document
from langchain_core.stores import InMemoryByteStore
from test_integrations import HashEmbeddings
from test_store import assert_same, make_state
from tiny import tiny_nugget_model, tiny_tokenizer

from nugget_rag import NuggetCompressor, NuggetStore
from nugget_rag.integrations import NuggetIndex
from nugget_rag.integrations.ingest.chunking import split_documents, token_splitter
from nugget_rag.integrations.local.files import IndexFileError
from nugget_rag.integrations.published.segments import (
    SegmentRef,
    VersionRecord,
    decode_segment,
    encode_segment,
    pointer_key,
    read_pointer,
    read_version,
    segment_key,
    version_key,
)
from nugget_rag.state import CorruptStateError, NuggetState
from nugget_rag.state.redaction import redacted

EXAMPLES = {"http": 40, "state": 150, "index": 150, "chunking": 60, "secrets": 100}
QUICK = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)


def damaged(data: bytes) -> st.SearchStrategy[bytes]:
    """`data` truncated, with bytes flipped or spliced in, or replaced by arbitrary bytes."""
    cut = st.integers(0, len(data)).map(lambda n: data[:n])
    flip = st.tuples(st.integers(0, len(data) - 1), st.integers(1, 255)).map(
        lambda f: data[:f[0]] + bytes([data[f[0]] ^ f[1]]) + data[f[0] + 1:])
    splice = st.tuples(st.integers(0, len(data)), st.binary(min_size=1, max_size=16)).map(
        lambda s: data[:s[0]] + s[1] + data[s[0]:])
    return st.one_of(cut, flip, splice, st.binary(max_size=64))


# ---------------------------------------------------------------------------------------------- NuggetState
STATES = [make_state(), make_state(k=5, seed=1).compact("int8"), make_state(k=4, seed=2).compact("int4")]


@settings(QUICK, max_examples=EXAMPLES["state"])
@given(st.sampled_from(STATES).flatmap(lambda s: st.tuples(st.just(s), damaged(s.to_bytes()))))
def test_damaged_state_bytes_are_refused_by_name_or_read_as_they_were(case):
    state, data = case
    try:
        read = NuggetState.from_bytes(data)
    except CorruptStateError:
        return
    assert_same(read, NuggetState.from_bytes(state.to_bytes()))  # only bytes that still verify are read


@settings(QUICK, max_examples=EXAMPLES["state"])
@given(st.sampled_from(STATES).flatmap(lambda s: damaged(s.to_bytes())))
def test_a_damaged_state_in_the_store_is_a_miss_and_the_store_goes_on(data):
    store = NuggetStore(byte_store=InMemoryByteStore(), max_memory_bytes=0)  # every get reads the byte store
    key = store.put("text", make_state())
    store.byte_store.mset([(key, data)])
    found = store.get("text", "fp")
    assert found is None or found.fingerprint == "fp"
    assert store.put("text", make_state()) == key and store.get("text", "fp") is not None


# ---------------------------------------------------------------------------------------------- published records
def published(store: NuggetStore) -> tuple[VersionRecord, bytes, bytes]:
    """Version 1 of the index "default" in `store`, two segments of two chunks: its record, a segment's bytes, and
    the pointer's."""
    refs = []
    for n in range(2):
        chunks = [Document(id=f"c{n}{i}", page_content=f"chunk {n}{i}", metadata={"source": f"s{n}"})
                  for i in range(2)]
        data = encode_segment(chunks, np.eye(2, 3, n, dtype=np.float32))
        sha = hashlib.sha256(data).hexdigest()
        store.byte_store.mset([(segment_key("default", sha), data)])
        refs.append(SegmentRef(sha256=sha, count=2, nbytes=len(data), sources=[f"s{n}"]))
    record = VersionRecord(name="default", version=1, count=4, dimension=3, manifest={"count": 4, "dimension": 3},
                           segments=refs)
    record_bytes = record.model_dump_json().encode()
    pointer = json.dumps({"version": 1, "sha256": hashlib.sha256(record_bytes).hexdigest()}).encode()
    store.byte_store.mset([(version_key("default", 1), record_bytes), (pointer_key("default"), pointer)])
    return record, store.byte_store.mget([segment_key("default", refs[0].sha256)])[0], pointer


STORE = NuggetStore(byte_store=InMemoryByteStore())
RECORD, SEGMENT, POINTER = published(STORE)
PART = st.sampled_from(["record", "segment", "pointer"])


@settings(QUICK, max_examples=EXAMPLES["index"])
@given(PART.flatmap(lambda part: st.tuples(st.just(part), damaged({"record": RECORD.model_dump_json().encode(),
                                                                    "segment": SEGMENT, "pointer": POINTER}[part]))))
def test_a_damaged_record_segment_or_pointer_is_a_named_error(case):
    part, data = case
    store = NuggetStore(byte_store=InMemoryByteStore())
    record, _, _ = published(store)
    key = {"record": version_key("default", 1), "segment": segment_key("default", record.segments[0].sha256),
           "pointer": pointer_key("default")}[part]
    store.byte_store.mset([(key, data)])
    try:
        found = read_pointer(store, "default")
        if found is None:
            return
        read, chunks, vectors = read_version(store, "default", found[1].version, found[1].sha256)
    except (IndexFileError, LookupError):  # DamagedIndexError, VersionRemovedError: named, with the repair
        return
    assert read == record and [d.id for d in chunks] == ["c00", "c01", "c10", "c11"] and vectors.shape == (4, 3)


@settings(QUICK, max_examples=EXAMPLES["index"])
@given(damaged(SEGMENT), st.integers(1, 3), st.sampled_from([None, 1, 3, 7]))
def test_any_segment_bytes_decode_or_are_refused_by_name(data, count, dimension):
    ref = SegmentRef(sha256="0" * 64, count=count, nbytes=max(len(data), 1))
    try:
        chunks, vectors = decode_segment(data, ref, dimension, "a segment")
    except IndexFileError:
        return
    assert len(chunks) == count == vectors.shape[0] and all(isinstance(d, Document) for d in chunks)


# ---------------------------------------------------------------------------------------------- chunking
TOKENIZER = tiny_tokenizer()


@settings(QUICK, max_examples=EXAMPLES["chunking"])
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=300), st.integers(4, 40), st.integers(0, 3),
       st.one_of(st.none(), st.text(max_size=10)))
@example("00000", 4, 0, None)  # found: the second chunk ("0") was placed inside the first, the last "0" in none
def test_chunks_are_at_most_chunk_tokens_and_cover_the_text(text, chunk_tokens, overlap, source):
    doc = Document(page_content=text, metadata={} if source is None else {"source": source})
    splitter = token_splitter(TOKENIZER, chunk_tokens, overlap)
    chunks = split_documents(splitter, [doc])
    covered = set()
    for chunk in chunks:
        start = chunk.metadata["start_index"]
        assert text[start:start + len(chunk.page_content)] == chunk.page_content
        assert len(TOKENIZER(chunk.page_content, add_special_tokens=False)["input_ids"]) <= chunk_tokens
        covered |= set(range(start, start + len(chunk.page_content)))
    assert all(i in covered for i, c in enumerate(text) if not c.isspace()), "text left out of every chunk"
    assert split_documents(splitter, [doc]) == chunks  # the same chunks, under the same ids, every time


# ---------------------------------------------------------------------------------------------- HTTP bodies
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from fastapi.testclient import TestClient

    from nugget_rag.serving import create_app

    folder = tmp_path_factory.mktemp("served")
    compressor = NuggetCompressor(model=tiny_nugget_model(), store=NuggetStore(directory=folder / "nuggets"))
    index = NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=0)
    index.ingest([Document(page_content="The falcon hunts over the river.", metadata={"source": "birds.txt"})])
    with TestClient(create_app(index, folder / "index", max_pending=4, max_body_bytes=20_000)) as client:
        yield client, index, folder


def stored(folder) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in folder.rglob("*") if p.is_file() and "jobs" not in p.parts}


SMALL = st.one_of(st.integers(-3, 4), JSON)  # token counts kept small: a body that is valid decodes few tokens
DOCUMENT = st.one_of(st.text(max_size=30), JSON, st.fixed_dictionaries(
    {"page_content": st.one_of(st.text(max_size=30), JSON)},
    optional={"metadata": st.one_of(st.dictionaries(st.text(max_size=8), JSON, max_size=3), JSON), "id": JSON,
              "type": st.sampled_from(["Document", "x"])}))
BODIES = {
    "/ask": st.fixed_dictionaries({"question": st.one_of(st.text(max_size=30), JSON)}, optional={
        "k": SMALL, "max_new_tokens": SMALL, "finish_sentence": SMALL, "stream": JSON, "passages": JSON,
        "resolution": st.one_of(st.sampled_from(["default", "nuggets", "text"]), JSON), "extra": JSON}),
    "/v1/chat/completions": st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), JSON),
         "content": st.one_of(st.text(max_size=20), JSON, st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "image"]), "text": st.one_of(st.text(max_size=20), JSON)}),
             max_size=2))}), max_size=3)},
        optional={"max_tokens": SMALL, "stream": JSON, "k": SMALL, "temperature": JSON}),
    "/ingest": st.fixed_dictionaries({"documents": st.one_of(st.lists(DOCUMENT, max_size=3), JSON)}),
    "/compress": st.fixed_dictionaries({"documents": st.one_of(st.lists(DOCUMENT, max_size=3), JSON)}),
    "/summarize": st.fixed_dictionaries({"documents": st.one_of(st.lists(DOCUMENT, max_size=2), JSON)}, optional={
        "max_new_tokens": SMALL, "reading": st.one_of(st.sampled_from(["sections", "nuggets"]), JSON)}),
    # never a valid job, which would change the store in the background: no "documents" key
    "/ingest/jobs": JSON.filter(lambda v: not (isinstance(v, dict) and "documents" in v)),
}
RAW = st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode()))


@pytest.mark.parametrize("path", list(BODIES))
def test_arbitrary_bodies_get_an_answer_or_a_4xx_never_a_500(served, path):
    client, index, folder = served

    @settings(QUICK, max_examples=EXAMPLES["http"])
    @given(st.one_of(BODIES[path].map(lambda v: json.dumps(v).encode()), RAW))
    @example(b'{"documents": [{}]}')  # found: a document without page_content was a TypeError, a 500
    def body_is_answered(body: bytes):
        before, chunks = stored(folder), len(index)
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code < 500, (response.status_code, response.text[:300])
        if response.status_code >= 400:
            assert response.json()  # a message: {"detail"} or OpenAI's {"error"}
            assert (stored(folder), len(index)) == (before, chunks), "a refused body changed the store"

    body_is_answered()


@pytest.mark.parametrize("path", ["/ingest", "/compress", "/ingest/jobs"])
def test_a_document_without_its_text_is_a_422_naming_the_field(served, path):
    client, index, folder = served
    before = stored(folder)
    response = client.post(path, json={"documents": [{"metadata": {"source": "a"}}]})
    assert response.status_code == 422 and "page_content" in response.text and stored(folder) == before


def test_a_chunk_of_repeated_text_starts_where_it_adds_text():
    chunks = split_documents(token_splitter(TOKENIZER, 4, 0), [Document(page_content="00000")])
    assert [(c.page_content, c.metadata["start_index"]) for c in chunks] == [("0000", 0), ("0", 4)]


# ---------------------------------------------------------------------------------------------- secrets printed
SECRET_TEXT = st.text(alphabet="abcdefghXYZ0123456789@:!$*-_~", min_size=6, max_size=16)


@settings(QUICK, max_examples=EXAMPLES["secrets"])
@given(SECRET_TEXT, st.sampled_from(["password", "api_key", "token", "secret"]), st.text(max_size=12),
       st.sampled_from(['{"connection": "%s"}', "could not reach %s.", "at '%s': refused", "%s"]))
def test_a_secret_in_a_url_is_never_printed(secret, name, noise, shape):
    url = f"postgresql+psycopg://app:{secret}@db.example:5432/docs?sslmode=require&{name}={secret}"
    text = noise + " " + shape % url
    shown = redacted(text)
    assert secret not in shown.replace(noise, "") and redacted(shown) == shown
    assert redacted({"settings": {name: secret, "url": url}}) == {"settings": {name: "***", "url": redacted(url)}}

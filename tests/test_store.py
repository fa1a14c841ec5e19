"""NuggetStore and DirectoryByteStore: round trips, LRU, corruption detection, concurrent writers."""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading
from pathlib import Path

import pytest
import torch
from langchain_core.stores import InMemoryByteStore
from langchain_tests.integration_tests import BaseStoreAsyncTests, BaseStoreSyncTests

from nugget_rag.state import CorruptStateError, NuggetState
from nugget_rag.state.directory_store import DirectoryByteStore
from nugget_rag.state.store import NuggetStore, StoreLocation


def make_state(fingerprint: str = "fp", k: int = 3, seed: int = 0) -> NuggetState:
    g = torch.Generator().manual_seed(seed)
    return NuggetState(
        keys=torch.randn(2, 1, k, 4, generator=g), values=torch.randn(2, 1, k, 4, generator=g),
        positions=torch.arange(k) * 2, scores=torch.randn(k, generator=g),
        tokens=[f"t{i}" for i in range(k)], n=2 * k, fingerprint=fingerprint,
    )


def assert_same(a: NuggetState, b: NuggetState) -> None:
    for name in ("keys", "values", "positions", "scores"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.tokens, a.n, a.fingerprint) == (b.tokens, b.n, b.fingerprint)


def entry_path(directory: Path, key: str) -> Path:
    return directory / key[:2] / key


def temp_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if "~" in p.name]


def test_round_trip_through_directory(tmp_path):
    state = make_state()
    writer = NuggetStore(directory=tmp_path)
    key = writer.put("doc", state)
    assert entry_path(tmp_path, key).is_file()
    assert writer.stats["writes"] == 1 and writer.stats["bytes_written"] == entry_path(tmp_path, key).stat().st_size

    fresh = NuggetStore(directory=tmp_path)
    assert_same(fresh.get("doc", "fp"), state)
    assert_same(fresh.get("doc", "fp"), state)
    assert fresh.stats == {"memory_hits": 1, "store_hits": 1, "misses": 0, "corrupt": 0, "writes": 0, "bytes_written": 0}
    assert_same(NuggetStore(directory=tmp_path).get_by_key(key), state)


def test_round_trip_through_shared_in_memory_byte_store():
    shared = InMemoryByteStore()
    state = make_state()
    writer = NuggetStore(byte_store=shared)
    key = writer.put("doc", state)
    assert writer.stats["writes"] == 1
    assert list(shared.yield_keys()) == [key]

    reader = NuggetStore(byte_store=shared)
    assert_same(reader.get("doc", "fp"), state)
    assert reader.stats["store_hits"] == 1


def test_other_fingerprint_or_text_misses():
    store = NuggetStore(byte_store=InMemoryByteStore())
    store.put("doc", make_state("fp"))
    assert store.get("doc", "other-fp") is None
    assert store.get("other doc", "fp") is None
    assert store.stats["misses"] == 2
    assert store.key("doc", "fp") != store.key("doc", "other-fp")


def test_memory_only_store_keeps_detached_cpu_copy():
    store = NuggetStore()
    state = make_state()
    state.scores.requires_grad_(True)
    store.put("doc", state)
    with torch.no_grad():
        state.keys.add_(1.0)  # the caller's tensors change; the cached copy must not
    cached = store.get("doc", "fp")
    assert not cached.scores.requires_grad
    assert torch.equal(cached.keys, make_state().keys)
    assert store.stats == {"memory_hits": 1, "store_hits": 0, "misses": 0, "corrupt": 0, "writes": 0, "bytes_written": 0}


def _flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 4] = bytes(b ^ 0xFF for b in data[mid : mid + 4])
    path.write_bytes(bytes(data))


def _flip_tensor_data(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-17])


@pytest.mark.parametrize("damage", [_flip_middle, _flip_tensor_data, _truncate])
def test_corrupt_file_is_detected_and_overwritten_by_put(tmp_path, caplog, damage):
    state = make_state()
    key = NuggetStore(directory=tmp_path).put("doc", state)
    damage(entry_path(tmp_path, key))

    store = NuggetStore(directory=tmp_path)
    with caplog.at_level(logging.WARNING, logger="nugget_rag.state.store"):
        assert store.get("doc", "fp") is None
    assert store.stats["corrupt"] == 1
    assert any(key in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert store.get_by_key(key) is None
    assert store.stats["corrupt"] == 2

    store.put("doc", state)
    assert_same(NuggetStore(directory=tmp_path).get("doc", "fp"), state)


def test_entry_with_wrong_fingerprint_is_corrupt(caplog):
    shared = InMemoryByteStore()
    key = NuggetStore.key("doc", "fp")
    shared.mset([(key, make_state("someone-else").to_bytes())])
    store = NuggetStore(byte_store=shared)
    with caplog.at_level(logging.WARNING, logger="nugget_rag.state.store"):
        assert store.get("doc", "fp") is None
    assert store.stats["corrupt"] == 1
    assert "someone-else" in caplog.text and key in caplog.text


def test_lru_evicts_least_recently_used_by_bytes():
    size = make_state().nbytes
    store = NuggetStore(max_memory_bytes=int(2.5 * size))
    for i, text in enumerate("abc"):
        store.put(text, make_state(seed=i))
        if text == "b":
            assert store.get("a", "fp") is not None  # touch a: b is now least recently used
    assert store.get("b", "fp") is None
    assert store.get("a", "fp") is not None and store.get("c", "fp") is not None


def test_entry_larger_than_memory_bound_is_not_kept_in_memory(tmp_path):
    state = make_state()
    store = NuggetStore(directory=tmp_path, max_memory_bytes=state.nbytes - 1)
    store.put("doc", state)
    assert_same(store.get("doc", "fp"), state)
    assert_same(store.get("doc", "fp"), state)
    assert store.stats["memory_hits"] == 0 and store.stats["store_hits"] == 2


def _states(writer: int) -> dict[str, NuggetState]:
    """The same key for every writer (content differs by writer) and one key of its own."""
    return {"a0ff": make_state(f"w{writer}", seed=writer),
            f"b{writer:02x}": make_state(f"w{writer}", seed=100 + writer)}


def _write_many(directory: str, writer: int, rounds: int) -> None:
    store = DirectoryByteStore(directory)
    pairs = [(key, state.to_bytes()) for key, state in _states(writer).items()]
    for _ in range(rounds):
        store.mset(pairs)


def _check_concurrent_result(directory: Path, writers: int) -> None:
    store = DirectoryByteStore(directory)
    shared = NuggetState.from_bytes(store.mget(["a0ff"])[0])
    assert_same(shared, _states(int(shared.fingerprint[1:]))["a0ff"])
    for w in range(writers):
        key = f"b{w:02x}"
        assert_same(NuggetState.from_bytes(store.mget([key])[0]), _states(w)[key])
    assert sorted(store.yield_keys()) == ["a0ff"] + [f"b{w:02x}" for w in range(writers)]
    assert temp_files(directory) == []


def run_threads(targets) -> None:
    """Run the callables in parallel threads and re-raise the first exception any of them raised."""
    errors: list[BaseException] = []

    def guarded(target) -> None:
        try:
            target()
        except BaseException as err:  # a thread's exception would otherwise be lost
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _read_many(directory: str, rounds: int) -> None:
    """Readers racing the writers must see a missing entry or a whole one, never a partial file."""
    store = DirectoryByteStore(directory)
    for _ in range(rounds):
        data = store.mget(["a0ff"])[0]
        if data is not None:
            NuggetState.from_bytes(data)


def test_concurrent_thread_writers_and_readers(tmp_path):
    writers = [lambda w=w: _write_many(str(tmp_path), w, 50) for w in range(8)]
    run_threads(writers + [lambda: _read_many(str(tmp_path), 300)] * 2)
    _check_concurrent_result(tmp_path, 8)


def test_concurrent_process_writers(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), w, 50)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    _check_concurrent_result(tmp_path, 3)


def test_concurrent_nugget_store_puts_and_gets(tmp_path):
    state = make_state()

    def work() -> None:
        store = NuggetStore(directory=tmp_path)
        for _ in range(20):
            store.put("doc", state)
            assert_same(store.get_by_key(store.key("doc", "fp")), state)
            assert_same(NuggetStore(directory=tmp_path).get("doc", "fp"), state)

    run_threads([work] * 8)
    assert temp_files(tmp_path) == []


ODD_KEYS = [".", "..", ".hidden", "../etc", "/etc/passwd", "ab/cd", "ab\\cd", "ABCD", "abcd ", "ab cd", "abc~1",
            "=", "%41", "A", "a", "é", "e\u0301", "\x00", "\ud800", "-rf", "foo", "bar", "jobs", "keys", "CON",
            "k" * 80, "日本語のキー"]


def test_any_string_key_round_trips_inside_the_directory_in_a_file_of_its_own(tmp_path):
    store = DirectoryByteStore(tmp_path / "store")
    store.mset([(key, f"value {i}".encode()) for i, key in enumerate(ODD_KEYS)])
    assert store.mget(ODD_KEYS) == [f"value {i}".encode() for i in range(len(ODD_KEYS))]
    assert sorted(store.yield_keys()) == sorted(ODD_KEYS)
    assert sorted(store.yield_keys("ab")) == ["ab cd", "ab/cd", "ab\\cd", "abcd ", "abc~1"]
    files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert len(files) == len(ODD_KEYS) and temp_files(tmp_path) == []
    assert {p.parent for p in files} == {tmp_path / "store" / "keys", tmp_path / "store" / "a"}  # "a" is hex
    assert len({p.name.lower() for p in files}) == len(files)  # apart on a case-insensitive file system too
    store.mdelete(ODD_KEYS[::2])
    assert store.mget(ODD_KEYS) == [None if i % 2 == 0 else f"value {i}".encode() for i in range(len(ODD_KEYS))]
    assert sorted(store.yield_keys()) == sorted(ODD_KEYS[1::2])


def test_hex_keys_keep_the_files_earlier_versions_wrote(tmp_path):
    key = "9f" + "0" * 62
    (tmp_path / "9f").mkdir()
    (tmp_path / "9f" / key).write_bytes(b"cached before")
    (tmp_path / "jobs").mkdir()  # ingest_jobs.py's records: no keys
    (tmp_path / "jobs" / "ingest-1.json").write_bytes(b"{}")
    store = DirectoryByteStore(tmp_path)
    assert store.mget([key]) == [b"cached before"] and list(store.yield_keys()) == [key]
    store.mset([("ab01", b"1"), ("e", b"2"), ("a.b-c_d", b"3")])
    assert [entry_path(tmp_path, k).read_bytes() for k in ("ab01", "e", "a.b-c_d")] == [b"1", b"2", b"3"]


def test_stray_files_in_the_escaped_folder_are_no_keys(tmp_path):
    store = DirectoryByteStore(tmp_path)
    store.mset([("foo", b"1")])
    for name in ("=foo~tmp123", "=%66oo", "=%ff", "=FOO", "foo", "=a%2"):  # a temp file, non-canonical, invalid
        (tmp_path / "keys" / name).write_bytes(b"x")
    assert list(store.yield_keys()) == ["foo"]


def test_keys_too_long_for_a_file_name_empty_or_not_strings_are_refused(tmp_path):
    store = DirectoryByteStore(tmp_path)
    store.mset([("k" * 239, b"fits")])  # "=" and 239 letters: 240 bytes, and 9 more for the temporary name
    for key in ("k" * 240, "é" * 50, "a" * 241):
        with pytest.raises(ValueError, match=r"over 240; use a shorter key") as err:
            store.mset([(key, b"x")])
        assert repr(key[:40]) in str(err.value)
    with pytest.raises(ValueError, match="invalid store key 12: store keys are strings"):
        store.mget([12])
    with pytest.raises(ValueError, match="invalid store key '': an empty key names nothing"):
        store.mset([("", b"x")])
    assert list(store.yield_keys()) == ["k" * 239]


class TestDirectoryByteStoreSync(BaseStoreSyncTests[bytes]):
    """LangChain's standard key-value suite: DirectoryByteStore is a ByteStore for any string key."""

    @pytest.fixture
    def kv_store(self, tmp_path) -> DirectoryByteStore:
        return DirectoryByteStore(tmp_path / "store")

    @pytest.fixture
    def three_values(self) -> tuple[bytes, bytes, bytes]:
        return b"foo", b"bar", b"\x00buzz\xff"


class TestDirectoryByteStoreAsync(BaseStoreAsyncTests[bytes]):
    """The same suite through amget/amset/amdelete/ayield_keys (BaseStore's defaults, on a thread)."""

    @pytest.fixture
    async def kv_store(self, tmp_path) -> DirectoryByteStore:
        return DirectoryByteStore(tmp_path / "store")

    @pytest.fixture
    def three_values(self) -> tuple[bytes, bytes, bytes]:
        return b"foo", b"bar", b"\x00buzz\xff"


def test_directory_store_keys_get_delete(tmp_path):
    store = DirectoryByteStore(tmp_path)
    store.mset([("ab01", b"1"), ("ab02", b"2"), ("cd03", b"3"), ("e", b"4")])
    (tmp_path / "ab" / "ab03~leftover").write_bytes(b"partial")  # a temp file is never a key
    assert sorted(store.yield_keys()) == ["ab01", "ab02", "cd03", "e"]
    assert sorted(store.yield_keys("ab")) == ["ab01", "ab02"]
    assert list(store.yield_keys("ab02")) == ["ab02"]
    assert list(store.yield_keys("c")) == ["cd03"]
    assert list(store.yield_keys("f")) == []
    assert store.mget(["ab01", "ffff", "e"]) == [b"1", None, b"4"]

    store.mset([("ab01", b"new")])
    store.mdelete(["ab02", "ffff"])
    assert store.mget(["ab01", "ab02"]) == [b"new", None]
    assert sorted(store.yield_keys()) == ["ab01", "cd03", "e"]


def test_failed_write_leaves_old_value_and_no_temp_file(tmp_path):
    store = DirectoryByteStore(tmp_path)
    store.mset([("ab01", b"old")])
    with pytest.raises(TypeError):
        store.mset([("ab01", 12345)])  # f.write fails after the temp file was created
    assert store.mget(["ab01"]) == [b"old"]
    assert temp_files(tmp_path) == []


def _digested(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    """Well-formed bytes with a valid digest: what a buggy or hostile writer could leave."""
    from safetensors.torch import save as save_tensors

    from nugget_rag.state.nugget_state import _digest

    return save_tensors(tensors, metadata={**meta, "digest": _digest(tensors, meta)})


@pytest.mark.parametrize("bad", ["list-header", "tokens-not-a-list", "values-shape", "scalar-positions"])
def test_well_digested_but_malformed_entries_are_corrupt(bad):
    state = make_state()
    tensors = {"keys": state.keys, "values": state.values, "positions": state.positions, "scores": state.scores}
    meta = {"format": "nugget-rag/state-v1", "n": "6", "fingerprint": "fp", "tokens": json.dumps(state.tokens)}
    if bad == "list-header":
        header = b"[]"
        data = len(header).to_bytes(8, "little") + header
    elif bad == "tokens-not-a-list":
        data = _digested(tensors, {**meta, "tokens": json.dumps("abc")})
    elif bad == "values-shape":
        data = _digested({**tensors, "values": state.values[:, :, :1].contiguous()}, meta)
    else:  # no digest can be computed over a 0-d tensor: any claimed one is checked, and must fail cleanly
        from safetensors.torch import save as save_tensors

        data = save_tensors({**tensors, "positions": torch.tensor(3)}, metadata={**meta, "digest": "0" * 64})
    with pytest.raises(CorruptStateError):
        NuggetState.from_bytes(data)


@pytest.mark.parametrize("kv_format", ["float32", "bfloat16", "float16", "int8", "int4"])
def test_compact_formats_round_trip_exactly_and_shrink_the_bytes(kv_format):
    g = torch.Generator().manual_seed(0)
    k = 64
    state = NuggetState(torch.randn(4, 2, k, 16, generator=g), torch.randn(4, 2, k, 16, generator=g), torch.arange(k),
                        torch.randn(k, generator=g), ["t"] * k, 10 * k, "fp")
    compact = state.compact(kv_format)
    read = NuggetState.from_bytes(compact.to_bytes())
    assert read.kv_format == kv_format and torch.equal(read.keys, compact.keys) and torch.equal(read.values, compact.values)
    step = {"int8": 1 / 127, "int4": 1 / 7}.get(kv_format, 0.01)  # a quantisation step, relative to the largest
    assert torch.allclose(read.keys.float(), state.keys, atol=step * float(state.keys.abs().max()))
    size, full = len(compact.to_bytes()), len(state.to_bytes())
    tensor_bytes = 2 * state.keys.numel() * 4
    saved = {"float32": 0, "bfloat16": tensor_bytes / 2, "float16": tensor_bytes / 2, "int8": tensor_bytes * 3 / 4,
             "int4": tensor_bytes * 7 / 8}
    assert size <= full - saved[kv_format] * 0.9  # scales and metadata cost little


def test_states_of_the_first_format_still_load():
    """A state written before kv_format existed (format v1, float32) reads as float32."""
    import json

    from safetensors.torch import save as save_tensors

    from nugget_rag.state.nugget_state import _digest

    state = make_state("fp")
    tensors = {"keys": state.keys, "values": state.values, "positions": state.positions, "scores": state.scores}
    meta = {"format": "nugget-rag/state-v1", "n": str(state.n), "fingerprint": "fp", "tokens": json.dumps(state.tokens)}
    meta["digest"] = _digest(tensors, meta)
    read = NuggetState.from_bytes(save_tensors(tensors, metadata=meta))
    assert read.kv_format == "float32" and torch.equal(read.keys, state.keys)
    with pytest.raises(CorruptStateError, match="unknown kv_format"):
        meta = {**meta, "format": "nugget-rag/state-v2", "kv_format": "int3"}
        meta["digest"] = _digest(tensors, {k: v for k, v in meta.items() if k != "digest"})
        NuggetState.from_bytes(save_tensors(tensors, metadata=meta))
    with pytest.raises(ValueError, match="unknown kv_format 'int3'"):
        state.compact("int3")


@pytest.mark.parametrize("value", ["redis://localhost:6379/0", "rediss://:secret@cache:6380/2?namespace=docs&ttl=60",
                                   "unix:///run/redis.sock?db=1&namespace=a/b", "/srv/nuggets"])
def test_a_store_location_parses_and_round_trips(value):
    location = StoreLocation.parse(value)
    assert StoreLocation.parse(location.url) == location
    assert StoreLocation.model_validate_json(location.model_dump_json()) == location  # as Ray ships it
    if location.is_redis:
        assert location.redis_url is not None and "namespace" not in location.redis_url
        assert "secret" not in str(location)  # messages and logs never show the password


def test_a_store_location_keeps_its_prefix_and_expiry():
    location = StoreLocation.parse("redis://cache:6379/0?namespace=docs&ttl=60")
    assert (location.redis_url, location.namespace, location.ttl) == ("redis://cache:6379/0", "docs", 60)
    assert StoreLocation.parse("file:///srv/nuggets") == StoreLocation(directory=Path("/srv/nuggets"))


@pytest.mark.parametrize(("value", "reason"), [("http://cache:6379", "the scheme 'http'"),
                                               ("redis://cache:port/0", "does not parse"),
                                               ("redis://:secret@cache:6379?ttl=soon", "has a bad setting")])
def test_a_bad_store_url_is_refused_by_name_with_the_fix(value, reason):
    with pytest.raises(ValueError, match=reason) as refused:
        StoreLocation.parse(value)
    message = str(refused.value)
    assert value.replace(":secret@", ":***@") in message and "give redis://HOST:PORT/DB" in message
    assert "secret" not in message


def test_a_store_says_where_it_lives(tmp_path):
    location = NuggetStore(directory=tmp_path / "nuggets").location
    assert location == StoreLocation(directory=(tmp_path / "nuggets").resolve())
    opened = location.open()
    assert opened.location == location and opened.redis_client is None
    assert NuggetStore().location is None and NuggetStore(byte_store=InMemoryByteStore()).location is None

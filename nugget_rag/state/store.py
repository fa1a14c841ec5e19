"""Content-addressed cache of NuggetStates: a bounded in-memory LRU over any LangChain ByteStore."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import torch
from langchain_core.stores import ByteStore
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from .directory_store import DirectoryByteStore
from .nugget_state import UNIDENTIFIED, CorruptStateError, NuggetState
from .redaction import redacted

logger = logging.getLogger(__name__)

STATE_KEY = re.compile(r"[0-9a-f]{64}")  # a state's key: sha256(fingerprint, text)
INDEXES_PREFIX = "indexes/"  # the indexes registered in a store (NuggetStore.register_index): what prune keeps

REDIS_SCHEMES = ("redis", "rediss", "unix")  # the URLs of a Redis store (redis-py's)
_URL_SETTINGS = ("namespace", "ttl")  # a store URL's query parameters that are the location's, not redis-py's
_FIX = "give redis://HOST:PORT/DB (or rediss://, unix:///SOCKET), optionally ?namespace=PREFIX, or a directory"


class StoreLocation(BaseModel):
    """Where a NuggetStore lives, so that another process (a server, a Ray worker) opens the same store: a Redis
    server (its keys under `namespace/`, kept `ttl` seconds) or a directory (on a filesystem every node sees).

    Parse what a user gives once (`parse`), pass the location down, and `open` it where the store is needed.
    """

    model_config = ConfigDict(frozen=True)

    redis_url: str | None = None
    namespace: str = "nugget-rag"
    ttl: int | None = None
    directory: Path | None = None

    @model_validator(mode="after")
    def _one_place(self) -> StoreLocation:
        if (self.redis_url is None) == (self.directory is None):
            raise ValueError("a store location needs redis_url or directory, and not both")
        if self.redis_url is not None:
            _check_redis_url(self.redis_url)
        return self

    @classmethod
    def parse(cls, value: str | Path) -> StoreLocation:
        """The location a user names: a Redis URL (`?namespace=PREFIX&ttl=SECONDS` set those), or a directory
        (a path, or file:///PATH). A ValueError names a value that is neither, and the fix."""
        if isinstance(value, Path):
            return cls(directory=value)
        scheme = _scheme(value)
        if scheme is None:
            return cls(directory=Path(value))
        if scheme == "file":
            return cls(directory=Path(unquote(urlsplit(value).path)))
        _check_redis_url(value)
        parts = urlsplit(value)
        query = parse_qsl(parts.query, keep_blank_values=True)
        settings = dict((k, v) for k, v in query if k in _URL_SETTINGS)
        rest = urlencode([(k, v) for k, v in query if k not in _URL_SETTINGS])
        try:
            return cls(redis_url=urlunsplit(parts._replace(query=rest)), **settings)
        except ValidationError as err:
            raise ValueError(f"store URL {redacted(value)!r} has a bad setting ({err.errors()[0]['msg']}): "
                             f"{_FIX}") from None

    @property
    def url(self) -> str:
        """The location as `parse` reads it: the Redis URL with its settings, or the directory's path."""
        if self.redis_url is None:
            return str(self.directory)
        settings = {"namespace": self.namespace} if self.namespace != "nugget-rag" else {}
        if self.ttl is not None:
            settings["ttl"] = str(self.ttl)
        if not settings:
            return self.redis_url
        joiner = "&" if urlsplit(self.redis_url).query else "?"
        return self.redis_url + joiner + urlencode(settings)

    @property
    def is_redis(self) -> bool:
        return self.redis_url is not None

    def open(self) -> NuggetStore:
        """The store here (a Redis server is checked now: StoreUnavailableError if it cannot be reached)."""
        if self.redis_url is not None:
            return NuggetStore.from_redis(self.redis_url, namespace=self.namespace, ttl=self.ttl)
        return NuggetStore(directory=self.directory)

    def __str__(self) -> str:
        """For messages and logs: the URL without its password."""
        return redacted(self.url)


def _scheme(value: str) -> str | None:
    """The URL scheme `value` names, or None for a path (a Windows drive letter is no scheme)."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):", value)
    return match.group(1).lower() if match else None


def _check_redis_url(url: str) -> None:
    """A ValueError naming `url` (without its password) unless it is a Redis URL that parses."""
    scheme = _scheme(url)
    if scheme not in REDIS_SCHEMES:
        raise ValueError(f"store URL {redacted(url)!r} names "
                         f"{'no scheme' if scheme is None else f'the scheme {scheme!r}'}, not a Redis one "
                         f"({', '.join(REDIS_SCHEMES)}): {_FIX}")
    try:
        urlsplit(url).port  # noqa: B018  (raises on a port that is not a number)
    except ValueError as err:
        raise ValueError(f"store URL {redacted(url)!r} does not parse ({redacted(str(err))}): {_FIX}") from None


class StoreUnavailableError(OSError):
    """The byte store behind a NuggetStore failed to read or write (a server down, a disk full)."""


class NuggetStore:
    """NuggetStates keyed by sha256(fingerprint, text): a byte-bounded memory LRU, then a ByteStore.

    With neither `byte_store` nor `directory` the cache lives in memory only. Entries read from the
    byte store are verified; a corrupt one is logged, counted in stats["corrupt"] and reported as a
    miss, so the caller recomputes it and `put` overwrites it. Returned states are shared with the
    cache: treat them as read-only.
    """

    def __init__(self, byte_store: ByteStore | None = None, directory: str | Path | None = None,
                 max_memory_bytes: int = 512 * 2**20):
        if byte_store is not None and directory is not None:
            raise ValueError("pass byte_store or directory, not both")
        self.byte_store = DirectoryByteStore(directory) if directory is not None else byte_store
        self.max_memory_bytes = max_memory_bytes
        self._redis: StoreLocation | None = None  # set by from_redis
        self.stats = {"memory_hits": 0, "store_hits": 0, "misses": 0, "corrupt": 0, "writes": 0, "bytes_written": 0}
        self._memory: OrderedDict[str, NuggetState] = OrderedDict()
        self._memory_bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def from_redis(cls, url: str, namespace: str = "nugget-rag", ttl: int | None = None,
                   max_memory_bytes: int = 512 * 2**20) -> NuggetStore:
        """A store shared through the Redis server at `url` (keys under `namespace/`); needs `pip install redis`.

        The server is checked now: if it cannot be reached, a StoreUnavailableError names the URL.
        """
        try:
            import redis  # noqa: F401  (RedisStore needs it)
            from langchain_community.storage import RedisStore
        except ImportError as err:
            raise ImportError(f"{err.name} is not installed: a Redis store needs nugget-rag's [redis] extra "
                              "(pip install 'nugget-rag[redis]')") from err
        byte_store = RedisStore(redis_url=url, namespace=namespace, ttl=ttl)
        try:
            byte_store.client.ping()
        except Exception as err:
            raise StoreUnavailableError(f"cannot reach Redis at {redacted(url)}: {redacted(str(err))}; start the "
                                        "server or fix the URL") from err
        store = cls(byte_store=byte_store, max_memory_bytes=max_memory_bytes)
        store._redis = StoreLocation(redis_url=url, namespace=namespace, ttl=ttl)
        return store

    @property
    def location(self) -> StoreLocation | None:
        """Where this store lives, for another process to open it: its Redis server or its directory; None for a
        store in memory only, or over another ByteStore."""
        if self._redis is not None:
            return self._redis
        if isinstance(self.byte_store, DirectoryByteStore):
            return StoreLocation(directory=self.byte_store.directory.resolve())
        return None

    @property
    def redis_client(self) -> Any:
        """The client of this store's Redis server (for records kept beside the states), or None: no Redis store."""
        return self.byte_store.client if self._redis is not None else None

    @staticmethod
    def key(text: str, fingerprint: str) -> str:
        """The content address of `text` compressed by whatever `fingerprint` names."""
        return hashlib.sha256(f"{fingerprint}\0{text}".encode()).hexdigest()

    def get(self, text: str, fingerprint: str) -> NuggetState | None:
        """The cached state for `text` under `fingerprint`, or None (a miss, or a corrupt entry)."""
        return self._get(self.key(text, fingerprint), fingerprint)

    def get_by_key(self, key: str) -> NuggetState | None:
        """The cached state at `key` (e.g. from a document's metadata), or None; bytes are verified."""
        return self._get(key, None)

    def put(self, text: str, state: NuggetState) -> str:
        """Cache a detached CPU copy of `state` in memory and in the byte store; returns its key."""
        if state.fingerprint.endswith(f":{UNIDENTIFIED}"):
            raise ValueError("this NuggetState comes from a training pass (compress(identify=False)): its fingerprint "
                             "does not name the weights that made it, so it cannot be stored; compress the document "
                             "with identify=True")
        key = self.key(text, state.fingerprint)
        state = _cpu_copy(state)
        self._remember(key, state)
        if self.byte_store is not None:
            data = state.to_bytes()
            try:
                self.byte_store.mset([(key, data)])
            except Exception as err:
                raise StoreUnavailableError(f"could not write nugget state {key} to {self._describe()}: {err}; "
                                            "states written before are intact, and a re-run recomputes the rest") from err
            self._count("writes", len(data))
        return key

    def delete(self, keys: Sequence[str]) -> None:
        """Remove the states at `keys` from memory and from the byte store."""
        with self._lock:
            for key in keys:
                old = self._memory.pop(key, None)
                if old is not None:
                    self._memory_bytes -= old.nbytes
        if self.byte_store is not None and keys:
            try:
                self.byte_store.mdelete(list(keys))
            except Exception as err:
                raise StoreUnavailableError(f"could not delete {len(keys)} nugget states from {self._describe()}: "
                                            f"{err}") from err

    # ------------------------------------------------------------------ the indexes over the store, and prune
    def register_index(self, location: str) -> None:
        """Record that the index at `location` ("HOST:PATH") keeps its chunks' states here (what `prune` keeps)."""
        if self.byte_store is not None:
            self.byte_store.mset([(self._index_key(location), json.dumps({"location": location}).encode())])

    def forget_index(self, location: str) -> None:
        """Forget the index at `location` (it was deleted): its states are no longer kept by `prune`."""
        if self.byte_store is not None:
            self.byte_store.mdelete([self._index_key(location)])

    def indexes(self) -> list[str]:
        """The locations ("HOST:PATH") of the indexes registered in this store."""
        if self.byte_store is None:
            return []
        # filtered here: ByteStores read `prefix` differently (RedisStore's matches only the key equal to it)
        keys = [key for key in self.byte_store.yield_keys() if key.startswith(INDEXES_PREFIX)]
        found = []
        for key, value in zip(keys, self.byte_store.mget(keys)):
            try:
                found.append(str(json.loads(value)["location"]))
            except (TypeError, ValueError, KeyError) as err:
                raise ValueError(f"the index record {key!r} in {self._describe()} is malformed ({err!r}); delete "
                                 "it, then save each index over this store again") from err
        return sorted(found)

    def prune(self, texts: Iterable[str], fingerprints: Iterable[str] = ()) -> dict[str, int]:
        """Delete every stored state that is not of one of `texts` (under the state's own fingerprint, any model or
        floor); returns {"kept", "removed", "bytes_removed"}. States under `fingerprints` are checked by their key
        alone; any other state is read for its fingerprint first. Entries that are not states are left alone; a
        corrupt state (never used) is removed."""
        texts = set(texts)
        referenced: dict[str, set[str]] = {fp: {self.key(t, fp) for t in texts} for fp in fingerprints}
        known = set().union(*referenced.values()) if referenced else set()
        report = {"kept": 0, "removed": 0, "bytes_removed": 0}
        if self.byte_store is None:
            return report
        stale = []
        for key in list(self.byte_store.yield_keys()):
            if not STATE_KEY.fullmatch(key):
                continue
            if key in known:
                report["kept"] += 1
                continue
            data = self.byte_store.mget([key])[0]
            if data is None:  # removed meanwhile
                continue
            try:
                fingerprint = NuggetState.stored_fingerprint(data)
            except CorruptStateError:
                fingerprint = None
            if fingerprint is not None and fingerprint not in referenced:
                referenced[fingerprint] = {self.key(t, fingerprint) for t in texts}
            if fingerprint is not None and key in referenced[fingerprint]:
                report["kept"] += 1
                continue
            stale.append(key)
            report["removed"] += 1
            report["bytes_removed"] += len(data)
        for start in range(0, len(stale), 256):
            self.delete(stale[start : start + 256])
        return report

    @staticmethod
    def _index_key(location: str) -> str:
        return INDEXES_PREFIX + hashlib.sha256(location.encode()).hexdigest()[:32]

    def _get(self, key: str, fingerprint: str | None) -> NuggetState | None:
        with self._lock:
            state = self._memory.get(key)
            if state is not None:
                self._memory.move_to_end(key)
                self.stats["memory_hits"] += 1
                return state
        try:
            data = self.byte_store.mget([key])[0] if self.byte_store is not None else None
        except Exception as err:
            raise StoreUnavailableError(f"could not read nugget state {key} from {self._describe()}: {err}") from err
        if data is None:
            self._count("misses")
            return None
        try:
            state = NuggetState.from_bytes(data)
        except CorruptStateError as err:
            return self._corrupt(key, str(err))
        if fingerprint is not None and state.fingerprint != fingerprint:
            return self._corrupt(key, f"fingerprint {state.fingerprint!r} is not {fingerprint!r}")
        self._count("store_hits")
        self._remember(key, state)
        return state

    def _describe(self) -> str:
        location = self.location
        return f"{type(self.byte_store).__name__}({location})" if location else type(self.byte_store).__name__

    def _corrupt(self, key: str, reason: str) -> None:
        logger.warning("nugget store entry %s is corrupt and was ignored: %s", key, reason)
        self._count("corrupt")

    def _remember(self, key: str, state: NuggetState) -> None:
        with self._lock:
            old = self._memory.pop(key, None)
            if old is not None:
                self._memory_bytes -= old.nbytes
            if state.nbytes > self.max_memory_bytes:
                return
            self._memory[key] = state
            self._memory_bytes += state.nbytes
            while self._memory_bytes > self.max_memory_bytes:
                _, evicted = self._memory.popitem(last=False)
                self._memory_bytes -= evicted.nbytes

    def _count(self, stat: str, nbytes: int = 0) -> None:
        with self._lock:
            self.stats[stat] += 1
            self.stats["bytes_written"] += nbytes


def _cpu_copy(state: NuggetState) -> NuggetState:
    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    return replace(state, keys=copy(state.keys), values=copy(state.values), positions=copy(state.positions),
                   scores=copy(state.scores), tokens=list(state.tokens))

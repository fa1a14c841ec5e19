"""DirectoryByteStore: a LangChain ByteStore in a directory, each value a file written whole or not at all."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import unquote_to_bytes

from langchain_core.stores import ByteStore

from .files import write_atomic

_HEX_KEY = re.compile(r"[0-9a-f][0-9a-f._-]*")  # NuggetStore's keys (sha256 digests): stored under their own name
ESCAPED_FOLDER = "keys"  # any other key, escaped; no hex shard has this name, nor job_records.py's jobs/
_SAFE = frozenset(b"0123456789abcdefghijklmnopqrstuvwxyz_-")  # bytes an escaped name keeps as they are
_ESCAPED_NAME = re.compile(r"=(?:[0-9a-z_-]|%[0-9a-f]{2})*")
MAX_NAME_BYTES = 240  # 255, a file name's limit on common file systems, less the temporary name's "~" and 8 more


class DirectoryByteStore(ByteStore):
    """A ByteStore in a local directory: one file per key, for any string key.

    Keys of lowercase hex (and . _ -), as NuggetStore writes them, are sharded as `directory/ab/abcdef...`; any
    other key is escaped into one file name under `directory/keys/`: "=" then the key's UTF-8 bytes, each byte
    outside [0-9a-z_-] written as %xx. Names stay inside their folder, differ for different keys (also on a
    case-insensitive file system) and read back as the key. Writes go to a temp file beside the target, are
    fsynced, then renamed over it with os.replace, so readers in any thread or process see either the old value
    or the new one, never a partial file.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for key in keys:
            try:
                values.append(self._path(key).read_bytes())
            except FileNotFoundError:
                values.append(None)
        return values

    def mset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        for key, value in key_value_pairs:
            path = self._path(key)
            path.parent.mkdir(exist_ok=True)
            write_atomic(path, value)  # its temporary name holds "~", never in a key's file name

    def mdelete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def yield_keys(self, prefix: str | None = None) -> Iterator[str]:
        prefix = prefix or ""
        for shard in sorted(self.directory.iterdir()):
            if not (shard.is_dir() and _HEX_KEY.fullmatch(shard.name) and shard.name.startswith(prefix[:2])):
                continue
            for entry in sorted(shard.iterdir()):
                # only keys: not a temporary file
                if _HEX_KEY.fullmatch(entry.name) and entry.name.startswith(prefix):
                    yield entry.name
        escaped = self.directory / ESCAPED_FOLDER
        if escaped.is_dir():
            for entry in sorted(escaped.iterdir()):
                key = _unescape(entry.name)
                if key is not None and key.startswith(prefix):
                    yield key

    def _path(self, key: str) -> Path:
        if not isinstance(key, str):
            raise ValueError(f"invalid store key {key!r}: store keys are strings")
        if not key:
            raise ValueError("invalid store key '': an empty key names nothing; use a non-empty string")
        if _HEX_KEY.fullmatch(key):
            path = self.directory / key[:2] / key
        else:
            path = self.directory / ESCAPED_FOLDER / _escape(key)
        if len(path.name.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"invalid store key {key[:40]!r}... ({len(key)} characters): its file name would take "
                             f"{len(path.name.encode())} bytes, over {MAX_NAME_BYTES}; use a shorter key "
                             "(e.g. its sha256 hex digest)")
        return path


def _escape(key: str) -> str:
    """The file name of a key that is not lowercase hex (see DirectoryByteStore)."""
    return "=" + "".join(chr(b) if b in _SAFE else f"%{b:02x}" for b in key.encode("utf-8", "surrogatepass"))


def _unescape(name: str) -> str | None:
    """The key whose file name is `name`, or None for a name no key has (a temporary file)."""
    if not _ESCAPED_NAME.fullmatch(name):
        return None
    try:
        key = unquote_to_bytes(name[1:]).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    return key if _escape(key) == name else None


__all__ = ["DirectoryByteStore"]

"""The lock a publish of an index holds (publishing.py), one publisher at a time: Redis's (a key that expires
should its holder die), a file lock beside a directory store, or a lock of this process for any other ByteStore.

A Redis lock that could not be released because the server was down (it was killed, or restarted) is released by
this process before it publishes again; another process waits until it expires (LOCK_TTL_S).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from filelock import FileLock, Timeout

from nugget_rag.cancellation import check
from nugget_rag.state.store import NuggetStore, StoreUnavailableError

from .segments import PREFIX, describe

log = logging.getLogger(__name__)

LOCK_TTL_S = 600  # a Redis lock whose holder died is free after this long
LOCK_POLL_S = 0.5  # how often a wait for another publisher checks whether its request was cancelled
_LOCAL_LOCKS: dict[tuple[int, str], threading.Lock] = {}
_LOCAL_LOCKS_GUARD = threading.Lock()
_UNRELEASED: dict[str, tuple[Any, str]] = {}  # Redis locks (and tokens) this process could not release, by `where`


class PublishLockLost(RuntimeError):
    """The publish lock expired (its holder took longer than LOCK_TTL_S) before the publish committed."""


class RedisPublishLock:
    def __init__(self, store: NuggetStore, name: str):
        key = f"{store.location.namespace}/{PREFIX}/{name}/lock"
        self.lock = store.redis_client.lock(key, timeout=LOCK_TTL_S, sleep=0.05)
        self.where = f"{key} in {describe(store)}"

    def acquire(self, timeout: float) -> bool:
        from redis.exceptions import LockError, RedisError

        try:
            if (unreleased := _UNRELEASED.get(self.where)) is not None:
                lock, token = unreleased
                try:
                    lock.do_release(token)
                except LockError:  # expired meanwhile (and maybe taken by another publisher)
                    pass
                del _UNRELEASED[self.where]
                log.info("released the publish lock %s, which this process held when the store went down", self.where)
            return bool(self.lock.acquire(blocking=True, blocking_timeout=timeout))
        except RedisError as err:
            raise StoreUnavailableError(f"could not take the publish lock {self.where}: {err}; start the server or "
                                        "fix the store's URL") from err

    def confirm(self) -> None:
        from redis.exceptions import LockError

        try:
            self.lock.reacquire()
        except LockError as err:
            raise PublishLockLost(f"the publish lock {self.where} expired after {LOCK_TTL_S} s, and another publisher "
                                  "may hold it: nothing was published; ingest again") from err

    def release(self) -> None:
        from redis.exceptions import LockError, RedisError

        token = self.lock.local.token  # which release() forgets before it reaches the server
        try:
            self.lock.release()
        except LockError:
            log.warning("the publish lock %s had expired when it was released", self.where)
        except RedisError as err:  # the server is down: released before this process publishes again
            _UNRELEASED[self.where] = (self.lock, token)
            log.warning("could not release the publish lock %s (%s): this process releases it before it publishes "
                        "again; another waits until it expires (%d s)", self.where, err, LOCK_TTL_S)


class FilePublishLock:
    def __init__(self, store: NuggetStore, name: str):
        self.lock = FileLock(store.location.directory / f"{PREFIX}-{name}.lock")

    def acquire(self, timeout: float) -> bool:
        try:
            self.lock.acquire(timeout=timeout)
        except Timeout:
            return False
        return True

    def confirm(self) -> None:
        pass

    def release(self) -> None:
        self.lock.release()


class ProcessPublishLock(FilePublishLock):
    def __init__(self, store: NuggetStore, name: str):
        with _LOCAL_LOCKS_GUARD:
            self.thread_lock = _LOCAL_LOCKS.setdefault((id(store.byte_store), name), threading.Lock())

    def acquire(self, timeout: float) -> bool:
        return self.thread_lock.acquire(timeout=timeout)

    def release(self) -> None:
        self.thread_lock.release()


class PublishLockBusy(TimeoutError):
    """Another publisher held the lock longer than the wait given."""


@contextmanager
def publish_lock(store: NuggetStore, name: str, wait_s: float | None = None) -> Iterator[PublishLock]:
    """Hold the lock of the index `name` in `store`, waiting (and logging that) while another publisher holds it, at
    most `wait_s` seconds (None: as long as it takes; then PublishLockBusy); a cancelled request (cancellation.py)
    stops waiting."""
    location = store.location
    if location is not None and location.is_redis:
        lock: PublishLock = RedisPublishLock(store, name)
    elif location is not None:
        lock = FilePublishLock(store, name)
    else:
        lock = ProcessPublishLock(store, name)
    if not lock.acquire(0):
        log.warning("another process is publishing the index %r in %s; waiting for it to finish", name,
                    describe(store))
        waited = 0.0
        while not lock.acquire(LOCK_POLL_S):
            check()
            waited += LOCK_POLL_S
            if wait_s is not None and waited >= wait_s:
                raise PublishLockBusy(f"another process has held the publish lock of the index {name!r} in "
                                      f"{describe(store)} for over {wait_s:g} s, and still does; nothing was changed: "
                                      "try again once it has published, or wait longer")
    try:
        yield lock
    finally:
        lock.release()


PublishLock = RedisPublishLock | FilePublishLock

__all__ = ["LOCK_TTL_S", "FilePublishLock", "ProcessPublishLock", "PublishLock", "PublishLockBusy", "PublishLockLost",
           "RedisPublishLock", "publish_lock"]

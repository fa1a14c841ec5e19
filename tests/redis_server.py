"""A real Redis server of its own: Debian's redis-server on a free port, its data in a given directory; for the tests
and the benchmarks (benchmarks/serve_throughput.py's `redis_server`). `start` skips the test, saying why, where
redis-server or the redis client is missing (`missing`)."""

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def missing() -> str | None:
    """Why no Redis server can start here; None when one can."""
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis client is not installed (pip install redis)"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install redis-server)"
    return None


class RedisServer:
    """`persist`: every write in its append-only file, synced (what the tests of a restart read back); else none."""

    def __init__(self, directory: Path, persist: bool = True):
        self.directory, self.port, self.persist = directory, free_port(), persist
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        """Start it and wait for its answer to a ping."""
        if reason := missing():
            import pytest

            pytest.skip(reason)
        import redis

        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else []
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", *persistence],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(30)
            self.process = None

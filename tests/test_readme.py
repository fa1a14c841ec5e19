"""Every Python block of README.md, and every example with its default arguments, runs as written, as on a fresh
clone: ../shared, beside this checkout here and in CI, is hidden from them."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
REDIS_URL = "redis://localhost:6379/0"
SHARED = REPO.parent / "shared"
# Runs the script argv[2] with every open or listing under argv[1] refused, as if that folder were not there.
WITHOUT_SHARED = """
import os, runpy, sys

hidden = os.path.abspath(sys.argv[1])


def refuse(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path == hidden or path.startswith(hidden + os.sep):
            raise PermissionError(f"{path}: ../shared is hidden here, as on a fresh clone with nothing beside it")


sys.addaudithook(refuse)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_without_shared(script: Path, cwd: Path) -> subprocess.CompletedProcess:
    """`script` run by this Python in `cwd`, with ../shared hidden from it."""
    return subprocess.run([sys.executable, "-c", WITHOUT_SHARED, str(SHARED), str(script)], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


def test_shared_is_hidden_from_what_runs_here(tmp_path):
    script = tmp_path / "reads_shared.py"
    script.write_text(f"open({str(SHARED / 'data' / 'splits.json')!r})\n")
    run = run_without_shared(script, tmp_path)
    assert run.returncode == 1 and "../shared is hidden here" in run.stderr, run.stderr[-3000:]


@pytest.fixture
def redis_at_default_port(tmp_path):
    """A Redis server at the README's URL: the one running there, else one started for the test."""
    with socket.socket() as sock:
        if sock.connect_ex(("127.0.0.1", 6379)) == 0:
            yield
            return
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
    server = subprocess.Popen(["redis-server", "--port", "6379", "--bind", "127.0.0.1", "--dir", str(tmp_path),
                               "--save", ""], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", 6379)) == 0:
                break
        time.sleep(0.05)
    yield
    server.terminate()
    server.wait(10)


@pytest.fixture
def pgvector_url(tmp_path_factory, monkeypatch):
    """PGVECTOR_URL, as a README block reads it: a throwaway PostgreSQL cluster with pgvector
    (tests/vector_databases.py), or the one the environment names."""
    if os.environ.get("PGVECTOR_URL"):
        yield
        return
    from vector_databases import postgres_cluster

    uri, server = postgres_cluster(tmp_path_factory.mktemp("postgres"))
    monkeypatch.setenv("PGVECTOR_URL", uri)
    yield
    server.cleanup()


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(block, tmp_path, request):
    if REDIS_URL in block:
        request.getfixturevalue("redis_at_default_port")
    if "PGVECTOR_URL" in block:
        request.getfixturevalue("pgvector_url")
    (tmp_path / "block.py").write_text(block)
    run = run_without_shared(tmp_path / "block.py", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.py")))
def test_example_runs_with_its_defaults(example, tmp_path):
    run = run_without_shared(REPO / "examples" / example, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip()
    if example == "summarize_long_document.py":  # what it is for: a document longer than the model's positions
        longer = re.search(r"\(([\d.]+)x the model's \d+ positions\)", run.stdout)
        assert longer and float(longer[1]) > 1, run.stdout[-3000:]

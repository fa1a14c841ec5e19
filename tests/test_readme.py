"""Every Python block of README.md, and every example with its default arguments, runs as written."""

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


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


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


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(block, tmp_path, request):
    if REDIS_URL in block:
        request.getfixturevalue("redis_at_default_port")
    run = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.py")))
def test_example_runs_with_its_defaults(example, tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "examples" / example)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip()

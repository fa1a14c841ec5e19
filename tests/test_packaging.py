"""The core install stays lean: the library and the CLI's parser load none of the extras' packages; a wheel holds
every subpackage."""

import subprocess
import sys
import tomllib
from pathlib import Path

EXTRA_MODULES = {"faiss", "datasets", "matplotlib", "sacrebleu", "rouge_score", "sentence_transformers",
                 "langchain_community", "langchain_text_splitters", "langchain_classic", "redis", "fastapi", "uvicorn",
                 "ray", "qdrant_client", "langchain_qdrant", "chromadb", "langchain_chroma", "langchain_postgres",
                 "psycopg"}


def test_core_imports_none_of_the_extras():
    code = ("import sys, nugget_rag, nugget_rag.cli; nugget_rag.cli.build_parser(); "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert not loaded & EXTRA_MODULES


def test_core_dependencies_leave_the_extras_out():
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("<")[0].split("=")[0].strip() for d in project["dependencies"]}
    assert not core & {"faiss-cpu", "datasets", "matplotlib", "sentence-transformers", "langchain-community", "redis"}
    extras = project["optional-dependencies"]
    assert {"retrieval", "train", "eval", "redis", "serve", "ray", "qdrant", "chroma", "postgres", "all", "dev"} <= set(
        extras)


def test_the_wheel_lists_every_subpackage():
    root = Path(__file__).parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(root).parts) for init in (root / "nugget_rag").rglob("__init__.py")
             if "integrations" not in init.parts}  # integrations/ is mapped in by package-dir
    assert found - listed == set(), f"pyproject.toml's packages leave out {sorted(found - listed)}"

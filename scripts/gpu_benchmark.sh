#!/usr/bin/env bash
# The first thing to run on a lent GPU: training throughput and MFU with the reference and the
# fused attention side by side, where a micro-batch's time goes, and time to first token and per-token decoding,
# Full against nuggets at 1, 4 and 16 documents, eager and with each decoding step a CUDA graph (about 5 minutes
# with the compile). BENCHMARKS.md takes its GPU figures from what this writes.
#
#   bash scripts/gpu_benchmark.sh OUT_DIR
#
# OUT_DIR receives attention-paths.md/json, training-throughput.md/json, step-profile.md/json, speed.md/json,
# speed-compiled.md/json and bench.log.
# Environment: PYTHON, WHEELS and DATA as for scripts/gpu_session.sh (an offline machine: scripts/offline_bundle.py);
# BATCH (default 64) the training micro-batch, STEPS (default 16) timed steps per arm.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_benchmark.sh OUT_DIR}
mkdir -p "$out"
log() { echo "[gpu_benchmark $(date +%T)] $*" | tee -a "$out/bench.log"; }

LOG_FILE="$out/bench.log"
source scripts/gpu_bundle.sh
source scripts/gpu_python.sh
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())" \
  | tee -a "$out/bench.log"

step() {  # NAME SECONDS COMMAND...: one part, bounded, its failure logged and the rest run
  local name=$1 seconds=$2; shift 2
  log "$name (at most ${seconds} s)"
  timeout "$seconds" "$@" >>"$out/bench.log" 2>&1 || log "$name stopped (rc $?)"
}
step "one training step, reference and fused attention (equal loss and gradients)" 40 "$py" \
  benchmarks/attention_paths.py --batch-size "${BATCH:-64}" --repeats 5
step "training throughput, reference and fused attention" 110 "$py" benchmarks/training_throughput.py \
  --batch-size "${BATCH:-64}" --steps "${STEPS:-16}" --group 16 --padding-batches 4 --attention reference fused
step "step profile, fused attention" 60 "$py" benchmarks/step_profile.py --batch-size "${BATCH:-64}" --warmup 1 \
  --attention fused --sources 3
cp benchmarks/results/attention-paths.* benchmarks/results/training-throughput.* benchmarks/results/step-profile.* \
  "$out"/ 2>/dev/null || true
step "time to first token and decoding, Full and nuggets" 60 "$py" -m nugget_rag.cli eval --tasks speed \
  --speed-docs 1 4 16 --ratios 10 --out-dir "$out" --name speed --no-plots -q
step "compiled decoding equals eager token for token (CUDA graphs)" 90 "$py" -m pytest -q -p no:cacheprovider \
  tests/test_static_decoding.py
step "the same speed run, each decoding step a CUDA graph" 150 "$py" -m nugget_rag.cli eval --tasks speed \
  --speed-docs 1 4 16 --ratios 10 --decoding compiled --out-dir "$out" --name speed-compiled --no-plots -q
log "done"
cat "$out"/attention-paths.md "$out"/training-throughput.md "$out"/step-profile.md "$out"/speed.md \
  "$out"/speed-compiled.md 2>/dev/null || true

#!/usr/bin/env bash
# The first thing to run on a lent GPU, bounded to BENCH_SECONDS (default 240) so that the call has time left to
# train: one training step with the reference and the fused attention (equal loss and gradients), training
# throughput and MFU of both, where a micro-batch's time goes, time to first token and decoding at 1, 4 and 16
# documents (Full against nuggets, eager and with each decoding step a CUDA graph), and compiled decoding against
# eager token for token. BENCHMARKS.md takes its GPU figures from what this writes.
#
#   bash scripts/gpu_benchmark.sh OUT_DIR
#
# OUT_DIR, which must be empty, receives 3 files: bench.md (every part's table, one after another), reports.tar.gz
# (each part's .md and .json) and bench.log. A part that runs out of its share of the time is logged and the rest run.
# Environment: PYTHON, PARTS, WHEELS and DATA as for scripts/gpu_session.sh; BATCH (default 64) the training
# micro-batch, STEPS (default 8) timed steps per arm; DRY_RUN=1 the CPU rehearsal: every part on a tiny random LLaMA
# and tiny data (tests/dry_run.py), one step each, the same OUT layout.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_benchmark.sh OUT_DIR}
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then
  echo "OUT_DIR $out already holds files; give an empty folder (at most 8 files come back from a GPU call)" >&2
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
deadline=$(( $(date +%s) + ${BENCH_SECONDS:-240} ))
log() { echo "[gpu_benchmark $(date +%T)] $*" | tee -a "$out/bench.log"; }

LOG_FILE="$out/bench.log"
source scripts/gpu_bundle.sh
source scripts/gpu_python.sh
reports=$(mktemp -d) tag="bench-$$-"
batch=${BATCH:-64} steps=${STEPS:-8} config=configs/recipe-r10.yaml
model_flags=() eval_flags=() speed_flags=(--speed-docs 1 4 16)
if [ -n "${DRY_RUN:-}" ]; then
  dry=$(mktemp -d)
  config=$("$py" tests/dry_run.py "$dry" "$config")
  batch=2 steps=1
  model_flags=(--base-model "$dry/base" --data "$dry/data/squad-dev-v1.1.json")
  eval_flags=(--base-model "$dry/base" --data-dir "$dry/data")
  speed_flags=(--speed-docs 1 4 --speed-repeats 1)
  log "dry run: every part on a tiny model and tiny data ($dry)"
fi

step() {  # NAME SHARE COMMAND...: one part, bounded by SHARE seconds and the deadline, its failure logged
  local name=$1 share=$2 left; shift 2
  left=$(( deadline - $(date +%s) ))
  [ "$share" -lt "$left" ] || share=$left
  if [ "$share" -lt 5 ]; then
    log "$name: skipped, BENCH_SECONDS spent"
    return 0
  fi
  log "$name (at most ${share} s)"
  timeout "$share" "$@" >>"$out/bench.log" 2>&1 || log "$name stopped (rc $?)"
}
step "one training step, reference and fused attention (equal loss and gradients)" 30 "$py" \
  benchmarks/attention_paths.py --batch-size "$batch" --repeats 2 --name "$tag"attention-paths "${model_flags[@]}"
step "training throughput: reference and fused attention, padded and packed" 80 "$py" benchmarks/training_throughput.py \
  --config "$config" --batch-size "$batch" --steps "$steps" --group 16 --padding-batches 2 --attention reference fused \
  --packing both \
  --name "$tag"training-throughput
step "step profile, fused attention" 30 "$py" benchmarks/step_profile.py --config "$config" --batch-size "$batch" \
  --warmup 1 --attention fused --sources 2 --name "$tag"step-profile
for file in benchmarks/results/"$tag"*; do  # this call's reports only, out of the tree
  [ -e "$file" ] && mv "$file" "$reports/${file#benchmarks/results/"$tag"}"
done
step "time to first token and decoding, Full and nuggets" 35 "$py" -m nugget_rag.cli eval --tasks speed \
  "${speed_flags[@]}" --ratios 10 --out-dir "$reports" --name speed --no-plots -q "${eval_flags[@]}"
if [ -z "${DRY_RUN:-}" ]; then
  step "compiled decoding equals eager token for token (CUDA graphs)" 30 "$py" -m pytest -q -p no:cacheprovider \
    tests/test_static_decoding.py -k cuda
else
  log "compiled decoding against eager on CUDA: skipped in a dry run (it needs a GPU; the suite runs the rest)"
fi
step "the same speed run, each decoding step a CUDA graph" 35 "$py" -m nugget_rag.cli eval --tasks speed \
  "${speed_flags[@]}" --ratios 10 --decoding compiled --out-dir "$reports" --name speed-compiled --no-plots -q \
  "${eval_flags[@]}"
for name in attention-paths training-throughput step-profile speed speed-compiled; do
  echo "## $name"
  if [ -f "$reports/$name.md" ]; then cat "$reports/$name.md"; else echo "did not finish (bench.log)"; fi
  echo
done >"$out/bench.md"
tar -czf "$out/reports.tar.gz" -C "$reports" .
log "done"
cat "$out/bench.md"

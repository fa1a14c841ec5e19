#!/usr/bin/env bash
# The first (or last) thing to run on a lent GPU, bounded to BENCH_SECONDS (default 150) on a fresh machine, install
# included, every part on a small fixed input and bounded by its own share: the pretraining stage's step
# (configs/pretrain.yaml at batch 16: updates/s, tokens/s and MFU), eager and with `compile: step`, and time to first
# token and decoding at 1, 4 and 16 documents of 256 tokens (Full against nuggets), eager and with each decoding step
# a CUDA graph. Each part logs its setup seconds (loading, tokenising, compiling) apart from its measured ones.
# BENCHMARKS.md takes its GPU figures from what this writes.
#
#   bash scripts/gpu_benchmark.sh OUT_DIR
#
# Budget (150 s), each part's end planned at the sum of the shares before it (a part that ends early leaves its time
# to the next; one that runs out of its share, or of BENCH_SECONDS, is stopped, logged, and the rest run). On the
# H200 of 2026-11-27 each Python process spent 10-15 s importing and loading before its first step, and tokenising
# ran at 40 examples/s, so the pretraining step reads READY's ready sets where given:
#   install (bundle)            10 s   on the chain call's warm machine (wheels and this tree installed already)
#   pretraining step            80 s   one process: loading, 8 steps eager, then 8 with `compile: step` (the first 4
#                                      compiling a graph per objective); its table is written after each arm
#   speed, eager                30 s   1, 4 and 16 documents, a warm-up and 2 repeats of 8 tokens each
#   speed, CUDA graphs          30 s   the same, the warm-ups recording the graphs
# BENCH_EXTRA=1 adds, after them, the attention paths' equality check (reference against fused, 30 s), the step
# profile (30 s) and compiled decoding against eager token for token (30 s): give BENCH_SECONDS=240 with it.
#
# OUT_DIR, which must be empty, receives 3 files: bench.md (every part's table, one after another), reports.tar.gz
# (each part's .md and .json) and bench.log. The pretraining step reads READY (scripts/gpu_bundle.sh: ready sets of
# configs/pretrain.yaml), else the first RECORDS of each source in ../corpus, else of the bundle's
# ../shared/data/python-3.11-docs.jsonl for both objectives.
# Environment: PYTHON, PARTS, READY, CORPUS, WHEELS and DATA as for scripts/gpu_session.sh; BATCH (default 16) the
# training micro-batch, STEPS (default 8) steps per arm, the first half a warm-up; RECORDS (default 100) records per
# source where no READY; DRY_RUN=1 the CPU rehearsal: every part on a tiny random LLaMA and tiny data
# (tests/dry_run.py), two steps an arm, each share times 4 (BENCH_SECONDS default 600), the same OUT layout.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_benchmark.sh OUT_DIR}
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then
  echo "OUT_DIR $out already holds files; give an empty folder (at most 8 files come back from a GPU call)" >&2
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
scale=1
[ -z "${DRY_RUN:-}" ] || scale=4
deadline=$(( $(date +%s) + ${BENCH_SECONDS:-$(( 150 * scale ))} )) planned=$(( $(date +%s) + 10 * scale ))
log() { echo "[gpu_benchmark $(date +%T)] $*" | tee -a "$out/bench.log"; }

LOG_FILE="$out/bench.log"
source scripts/gpu_bundle.sh
source scripts/gpu_python.sh
reports=$(mktemp -d) tag="bench-$$-"
batch=${BATCH:-16} steps=${STEPS:-8} records=${RECORDS:-100} config=configs/pretrain.yaml
recipe=configs/recipe-r10.yaml
data_flags=() model_flags=() eval_flags=() compile_flags=()
speed_flags=(--speed-docs 1 4 16 --speed-repeats 2 --speed-doc-tokens 256 --speed-decode-steps 8 --speed-no-policy)
if [ -n "${DRY_RUN:-}" ]; then
  dry=$(mktemp -d)
  config=$("$py" tests/dry_run.py "$dry" "$config")
  [ -z "${BENCH_EXTRA:-}" ] || recipe=$("$py" tests/dry_run.py "$dry/recipe" "$recipe")
  batch=2 steps=2 records=40 ready_flags=()  # the tiny model's tokenizer: the ready sets of READY are not its
  data_flags=(--records "$records")
  model_flags=(--base-model "$dry/base" --data "$dry/data/squad-dev-v1.1.json")
  eval_flags=(--base-model "$dry/base" --data-dir "$dry/data")
  speed_flags=(--speed-docs 1 4 16 --speed-repeats 1 --speed-doc-tokens 64 --speed-decode-steps 4 --speed-no-policy
               --task-split speed=all)  # the tiny data's test part is short
  compile_flags=(--compile-backend aot_eager)  # traced and checked without inductor's code generation (minutes here)
  log "dry run: every part on a tiny model and tiny data ($dry)"
elif [ ${#ready_flags[@]} -gt 0 ]; then
  log "the pretraining step reads the ready sets of READY (no tokenising)"
elif [ ! -d ../corpus ]; then
  data_flags=(--data ../shared/data/python-3.11-docs.jsonl --records "$records")
  log "no ../corpus: the pretraining step reads the first $records records of ${data_flags[1]} for both objectives"
else
  data_flags=(--records "$records")
fi

step() {  # NAME SHARE COMMAND...: one part, to end by the planned end (SHARE x scale later) and the deadline
  local name=$1 share begun
  planned=$(( planned + $2 * scale ))
  shift 2
  share=$(( (planned < deadline ? planned : deadline) - $(date +%s) ))
  if [ "$share" -lt 5 ]; then
    log "$name: skipped, no time left"
    return 0
  fi
  log "$name (at most ${share} s)"
  begun=$(date +%s)
  if timeout "$share" "$@" >>"$out/bench.log" 2>&1; then
    log "$name: done in $(( $(date +%s) - begun )) s"
  else
    log "$name stopped (rc $?)"
  fi
}
train_flags=(--config "$config" "${data_flags[@]}" "${ready_flags[@]}" --batch-size "$batch" --steps "$steps"
             --group 16 --padding-batches 1)
step "pretraining step, eager then compile: step (setup, warm-up and measured seconds per arm)" 80 "$py" \
  benchmarks/training_throughput.py "${train_flags[@]}" --compile off step "${compile_flags[@]}" --name "$tag"pretrain-step
step "time to first token and decoding, Full and nuggets, eager" 30 "$py" -m nugget_rag.cli eval --tasks speed \
  "${speed_flags[@]}" --ratios 10 --out-dir "$reports" --name speed --no-plots "${eval_flags[@]}"
step "the same, each decoding step a CUDA graph" 30 "$py" -m nugget_rag.cli eval --tasks speed \
  "${speed_flags[@]}" --ratios 10 --decoding compiled --out-dir "$reports" --name speed-compiled --no-plots \
  "${eval_flags[@]}"
parts=(pretrain-step speed speed-compiled)
if [ -n "${BENCH_EXTRA:-}" ]; then
  parts+=(attention-paths step-profile)
  step "one training step, reference and fused attention (equal loss and gradients)" 30 "$py" \
    benchmarks/attention_paths.py --batch-size "$batch" --repeats 2 --name "$tag"attention-paths "${model_flags[@]}"
  step "step profile, fused attention" 30 "$py" benchmarks/step_profile.py --config "$recipe" \
    --batch-size "$batch" --warmup 1 --attention fused --sources 2 --name "$tag"step-profile
  if [ -z "${DRY_RUN:-}" ]; then
    step "compiled decoding equals eager token for token (CUDA graphs)" 30 "$py" -m pytest -q -p no:cacheprovider \
      tests/test_static_decoding.py -k cuda
  else
    log "compiled decoding against eager on CUDA: skipped in a dry run (it needs a GPU; the suite runs the rest)"
  fi
fi
for file in benchmarks/results/"$tag"*; do  # this call's reports only, out of the tree
  [ -e "$file" ] && mv "$file" "$reports/${file#benchmarks/results/"$tag"}"
done
for name in "${parts[@]}"; do
  echo "## $name"
  if [ -f "$reports/$name.md" ]; then cat "$reports/$name.md"; else echo "did not finish (bench.log)"; fi
  echo
done >"$out/bench.md"
tar -czf "$out/reports.tar.gz" -C "$reports" .
log "done"
cat "$out/bench.md"

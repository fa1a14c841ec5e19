#!/usr/bin/env bash
# One bounded step of a training stage on a GPU machine (TRAINING.md, "On a GPU"): continue training, score dev,
# leave an export small enough to bring back and commit. Re-run it and it goes on where it stopped.
#
#   bash scripts/gpu_session.sh OUT_DIR [SECONDS] [more `nugget-rag train` flags]
#
# SECONDS (default 540) bounds the whole step: training stops, with a checkpoint, early enough for the dev scoring
# (EVAL_SECONDS, default 150; 30 without scoring, for the export) to fit. OUT_DIR, which must be empty, receives at
# most 8 files:
#   export/nugget.safetensors, export/nugget_config.json   the bf16 export (15 MB for the default model; its
#                                                          config records the steps trained and the lineage: every
#                                                          call of the chain, with totals)
#   dev.json, dev.md, dev-predictions.jsonl                the dev scores (EVAL_TASKS at EVAL_RATIOS; what finished
#                                                          within the limit; none with EVAL_TASKS=none)
#   metrics.jsonl, loss.png                                the run's metric lines and its plot
#   train.log                                              the run's log
# Environment:
#   RUN     training state (optimizer included), default /tmp/nugget-recipe: while it holds a checkpoint the
#           step resumes from it exactly; otherwise training starts from INIT
#   INIT    an export to start from (a previous step's OUT_DIR/export), default the shipped checkpoint
#   CONFIG  the stage, default configs/recipe-r10.yaml (configs/pretrain.yaml: the pretraining stage)
#   EVAL_TASKS  default "squad autoencoding"; "none" (or empty): no dev scoring;  EVAL_RATIOS  default "5 10";
#           EVAL_LIMIT  dev questions (a random sample), default 300;  EVAL_BATCH  examples generated together
#           while scoring dev, default 64
#   PYTHON  an interpreter with nugget-rag importable; default .venv/bin/python, installed first if missing
#           (with WHEELS: python3, the machine's own PyTorch)
#   PARTS   a folder of scripts/offline_bundle.py parts (PARTS/1, PARTS/2, ...), joined and checked here; sets
#           WHEELS and DATA
#   WHEELS  a folder of wheels to install offline first (a machine without a package index)
#   DATA    the data folder the stage reads as ../shared/data, where that is missing (the bundle's data/)
#   READY   ready sets, a folder or one .tar.xz of it (`nugget-rag train --config CONFIG --write-ready DIR`, here):
#           the sources' examples already tokenised, so the call trains without tokenising them (gpu_bundle.sh)
#   DRY_RUN=1  the CPU rehearsal: a tiny random LLaMA, tiny data in every format the stage reads, one step, the
#           same parts and the same OUT layout (tests/dry_run.py; tests/test_gpu_scripts.py runs it)
# A stage run as a chain of calls, each from the previous call's export: the first with INIT=<the stage's start>,
# each later one with INIT=<previous OUT_DIR>/export and `--chain true` (the schedule goes on; TRAINING.md "A chain
# of calls"); to spend the call on training, EVAL_TASKS=none and `--eval-every 0 --eval-generate 0`. The log gives
# the seconds of setup (before the trainer, and to its first update: metrics.jsonl's "setup" line) apart.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_session.sh OUT_DIR [SECONDS] [train flags]}
limit=${2:-540}
shift $(( $# < 2 ? $# : 2 ))
begin=$(date +%s)
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then
  echo "OUT_DIR $out already holds files; give an empty folder (at most 8 files come back from a GPU call)" >&2
  exit 2
fi
mkdir -p "$out"
log() { echo "[gpu_session $(date +%T)] $*" | tee -a "$out/train.log"; }

tasks=${EVAL_TASKS-squad autoencoding}
if [ "$tasks" = none ]; then tasks=; fi
eval_s=${EVAL_SECONDS:-$([ -n "$tasks" ] && echo 150 || echo 30)}
if [ $(( limit - eval_s )) -lt 30 ]; then  # refused before the setup's minutes
  log "only $(( limit - eval_s )) s left for training after the dev scoring's ${eval_s} s: give more SECONDS"
  exit 2
fi

LOG_FILE="$out/train.log"
source scripts/gpu_bundle.sh
source scripts/gpu_python.sh

run=${RUN:-/tmp/nugget-recipe}
init=${INIT:-default}
config=${CONFIG:-configs/recipe-r10.yaml}
init_flags=(--init-from "$init") eval_flags=()
if [ -n "${DRY_RUN:-}" ]; then
  dry=$(mktemp -d)
  config=$("$py" tests/dry_run.py "$dry" "$config")
  run=$dry/run init="nothing (the dry run's config)" init_flags=()
  eval_flags=(--base-model "$dry/base" --data-dir "$dry/data")
  log "dry run: ${CONFIG:-configs/recipe-r10.yaml} on a tiny model and tiny data, one step ($dry)"
fi
train_s=$(( limit - eval_s - ($(date +%s) - begin) ))
if [ "$train_s" -lt 30 ]; then
  log "only ${train_s} s left for training after setup and the dev scoring's ${eval_s} s: give more SECONDS"
  exit 2
fi
log "setup before the trainer (install, bundle, data): $(( $(date +%s) - begin )) s"
log "training for at most ${train_s} s into $run (from ${init} unless $run holds a checkpoint)"
PYTHONUNBUFFERED=1 "$py" -m nugget_rag.train --config "$config" --output-dir "$run" "${init_flags[@]}" \
  "${ready_flags[@]}" --max-time "$train_s" "$@" 2>&1 | tr '\r' '\n' | grep -v '^training: ' >>"$out/train.log"
log "trainer setup to its first update: $(grep '"kind": "setup"' "$run/metrics.jsonl" | tail -1 || true)"

rm -rf "$out/export" && cp -r "$run/final" "$out/export"
cp "$run/metrics.jsonl" "$out/" 2>/dev/null || true
cp "$run/loss.png" "$out/" 2>/dev/null || true
if [ -z "$tasks" ]; then
  log "no dev scoring (EVAL_TASKS=none); done in $(( $(date +%s) - begin )) s"
  exit 0
fi
left=$(( limit - ($(date +%s) - begin) - 5 ))
if [ "$left" -lt 20 ]; then
  log "no time left to score dev (setup outran EVAL_SECONDS=${eval_s}): the export is in $out/export"
  exit 0
fi
log "scoring dev in at most ${left} s"
# shellcheck disable=SC2086  # the task and ratio lists are word lists
timeout "$left" "$py" -m nugget_rag.cli eval --tasks $tasks --systems nugget \
  --ratios ${EVAL_RATIOS:-5 10} --split dev --limit "${EVAL_LIMIT:-300}" --sample random --task-limit autoencoding=10 \
  --ae-lengths 100 200 --batch-size "${EVAL_BATCH:-64}" --checkpoint "$out/export" --out-dir "$out" --name dev \
  --no-plots -q "${eval_flags[@]}" >>"$out/train.log" 2>&1 || log "dev scoring stopped (rc $?): the export is in $out/export all the same"
log "done in $(( $(date +%s) - begin )) s"

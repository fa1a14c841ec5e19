#!/usr/bin/env bash
# The dev runs that decide the default (MODEL_CARD.md "Choosing the next default"): one checkpoint scored on every
# measure of the rule, each run a harness output (NAME.json, NAME-predictions.jsonl) in OUT_DIR. Score the shipped
# default and a candidate into two folders, then compare them with benchmarks/default_decision.py.
#
#   bash scripts/score_candidate.sh CHECKPOINT OUT_DIR [MEASURE ...]
#
# CHECKPOINT: a nugget checkpoint directory, or "default" (the shipped one). MEASURE: any of squad-s0 squad-s1
# squad-s2 squad_rag ae-corpus ae-pydocs summaries (default: all). A run already in OUT_DIR is resumed, not redone (--resume),
# so the script can be stopped and started again. Dev parts only: the decision never reads a test part.
# Environment: THREADS (default 2), CORPUS (default ../corpus: scripts/build_corpus.py's output, for ae-corpus),
# DATA (default ../shared/data).
set -euo pipefail
cd "$(dirname "$0")/.."
checkpoint=${1:?usage: score_candidate.sh CHECKPOINT OUT_DIR [MEASURE ...]}
out=${2:?usage: score_candidate.sh CHECKPOINT OUT_DIR [MEASURE ...]}
shift 2
measures=("$@")
[ ${#measures[@]} -gt 0 ] || measures=(squad-s0 squad-s1 squad-s2 squad_rag ae-corpus ae-pydocs summaries)
corpus=${CORPUS:-../corpus}
data=${DATA:-../shared/data}
nugget_rag=${NUGGET_RAG:-.venv/bin/nugget-rag}
common=(--split dev --checkpoint "$checkpoint" --threads "${THREADS:-2}" --data-dir "$data" --out-dir "$out"
        --resume --no-plots)
mkdir -p "$out"
for measure in "${measures[@]}"; do
  echo "[score $(date +%T)] $measure ($checkpoint)"
  case $measure in
    squad-s[0-9])  # 200 random dev questions a seed; seeds 0-2 give 508 distinct ones
      "$nugget_rag" eval --tasks squad --systems nugget_float32 --ratios 10 5 --limit 200 --sample random \
        --sample-seed "${measure#squad-s}" --batch-size 8 --name "$measure" "${common[@]}" ;;
    squad_rag)  # the QA chain's reading plan, decoded as NuggetLLM decodes by default
      "$nugget_rag" eval --tasks squad_rag --systems default_reading --ratios 10 --limit 200 --sample random \
        --qa-finish-sentence 32 --qa-no-repeat-ngram 8 --batch-size 8 --name "$measure" "${common[@]}" ;;
    ae-corpus)  # the 30 corpus dev passages every chain export is scored on (TRAINING.md)
      "$nugget_rag" eval --tasks autoencoding --data "autoencoding=$corpus/dev.jsonl" --systems nugget --ratios 1 2 10 \
        --limit 30 --sample random --task-limit autoencoding=30 --ae-lengths 100 --batch-size 15 \
        --name "$measure" "${common[@]}" ;;
    ae-pydocs)  # Python docs, a domain neither the chain nor the fine-tuning trains on: the dev part (every 20th train
      # file) holds 22 passages of 100 tokens, each scored (--limit 30 takes them all)
      "$nugget_rag" eval --tasks autoencoding --systems nugget --ratios 1 2 10 --limit 30 --sample random \
        --task-limit autoencoding=30 --ae-lengths 100 --batch-size 15 --name "$measure" "${common[@]}" ;;
    summaries)  # 8 dev digests of 12 CNN/DM dev articles each (8,000-10,000 tokens), summarised in the
      # shipped reading (the outline at r = 4) and scored by ROUGE-L against their highlights; not resumed (8-15 min)
      [ -f "$out/summaries-predictions.jsonl" ] && { echo "[score] summaries: already in $out"; continue; }
      "${PYTHON:-.venv/bin/python}" benchmarks/long_documents.py --split dev --digests 8 --topics --systems outline_r4 \
        --checkpoint "$checkpoint" --threads "${THREADS:-2}" --data "$data/cnndm-test-250.jsonl" \
        --out "$out/summaries-report" --predictions "$out/summaries" ;;
    *) echo "unknown measure $measure: use squad-s0 squad-s1 squad-s2 squad_rag ae-corpus ae-pydocs summaries" >&2
       exit 2 ;;
  esac
done

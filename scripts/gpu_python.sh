# Sourced by the GPU scripts: sets `py` to an interpreter that imports nugget_rag and every module the scripts use,
# installing first if it must, and stops (exit 3) naming what is missing before anything trains.
# Needs `log` and LOG_FILE (where the install's output goes). Environment: PYTHON, WHEELS, DATA (gpu_session.sh);
# NEEDS: modules the calling script imports beyond GPU_MODULES (scripts/offline_bundle.py), e.g. "faiss".
py=${PYTHON:-.venv/bin/python}
if [ -n "${WHEELS:-}" ]; then
  # The bundle's wheels, then the project itself from this working tree (it travels with every call, so it is never
  # older than the scripts). PYTHONSAFEPATH keeps the tree's own nugget_rag/ (which lacks the
  # nugget_rag.integrations mapping) off sys.path, so the installed package is the one imported.
  # A later call on the same warm machine keeps the wheels installed (a marker names them) and reinstalls the
  # project only when this call's tree differs from the one installed (another marker; about 25 s of a GPU call).
  py=${PYTHON:-python3}
  site=/tmp/nugget-site
  wheels_id=$(cat "$WHEELS"/*.whl | sha256sum | cut -c1-16)
  if [ "$(cat "$site/.wheels" 2>/dev/null)" = "$wheels_id" ]; then
    log "the wheels of $WHEELS are installed in $site already"
  elif ! "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl >>"$LOG_FILE" 2>&1; then
    log "installing from $WHEELS failed (a wheel for another Python or platform? see $LOG_FILE): nothing trained"
    exit 3
  else
    echo "$wheels_id" >"$site/.wheels"
  fi
  tree_id=$({ tar -c --sort=name --mtime=@0 --owner=0 --group=0 --exclude=__pycache__ pyproject.toml nugget_rag \
                integrations 2>/dev/null
              echo "${NEEDS:-}"; } | sha256sum | cut -c1-16)  # the tree, and the imports it was checked for
  if [ "$(cat "$site/.tree" 2>/dev/null)" = "$tree_id" ]; then
    log "this tree's nugget-rag is installed in $site already"
    checked=1
  elif ! "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$site" . \
        >>"$LOG_FILE" 2>&1; then
    log "installing from $WHEELS failed (a wheel for another Python or platform? see $LOG_FILE): nothing trained"
    exit 3
  fi
  export PYTHONPATH=$site:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1  # benchmarks: their helpers
fi
if [ -n "${DATA:-}" ] && [ ! -e ../shared/data ]; then
  mkdir -p ../shared && ln -s "$(cd "$DATA" && pwd)" ../shared/data
fi
if [ -z "${WHEELS:-}" ] && ! "$py" -c "import nugget_rag" 2>/dev/null; then
  log "installing (scripts/install.sh)"
  bash scripts/install.sh >>"$LOG_FILE" 2>&1
  py=.venv/bin/python
fi
# What the GPU scripts import (offline_bundle.py's GPU_MODULES, and NEEDS); one missing is named here, not minutes
# into a run.
# shellcheck disable=SC2086  # NEEDS is a word list
if [ -z "${checked:-}" ]; then
  if ! missing=$("$py" scripts/offline_bundle.py --check-imports ${NEEDS:-} 2>>"$LOG_FILE"); then
    log "the install lacks what the scripts import: ${missing:-see $LOG_FILE}; nothing trained"
    exit 3
  fi
  [ -z "${tree_id:-}" ] || echo "$tree_id" >"$site/.tree"  # checked: a later call from the same tree skips both
fi
log "ready: $("$py" -c 'import sys, torch; print(sys.executable, "torch", torch.__version__, "cuda", torch.cuda.is_available())')"

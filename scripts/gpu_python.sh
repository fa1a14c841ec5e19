# Sourced by the GPU scripts: sets `py` to an interpreter that imports nugget_rag, installing first if it must.
# Needs `log` and LOG_FILE (where the install's output goes). Environment: PYTHON, WHEELS, DATA (gpu_session.sh).
py=${PYTHON:-.venv/bin/python}
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nugget-site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/nugget-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  py=${PYTHON:-python3}
fi
if [ -n "${DATA:-}" ] && [ ! -e ../shared/data ]; then
  mkdir -p ../shared && ln -s "$(cd "$DATA" && pwd)" ../shared/data
fi
if ! "$py" -c "import nugget_rag" 2>/dev/null; then
  log "installing (scripts/install.sh)"
  bash scripts/install.sh >>"$LOG_FILE" 2>&1
  py=.venv/bin/python
fi

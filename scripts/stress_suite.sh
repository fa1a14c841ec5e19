#!/usr/bin/env bash
# The server, Ray, ingest-job and Redis-fault tests on a busy machine: two CPU-bound processes run beside them throughout, so
# their time bounds must hold with the cores taken. Not part of CI; run it before changing those tests.
#
#   bash scripts/stress_suite.sh              # PYTHON=... picks the interpreter (default .venv/bin/python)
#   bash scripts/stress_suite.sh -x -k job    # any further arguments go to pytest
#
# Its exit status is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
burners=()
trap 'kill "${burners[@]}" 2>/dev/null || true' EXIT
for _ in 1 2; do
    "$PYTHON" -c "while True: pass" &
    burners+=($!)
done
status=0
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_server.py tests/test_ray_serve.py tests/test_ray_ingest.py \
    tests/test_redis.py::test_ingest_jobs_are_recorded_in_redis_for_every_server_over_it tests/test_ingest_jobs.py \
    tests/test_redis_faults.py \
    "$@" || status=$?
echo "stress_suite: pytest exited $status with 2 CPU-bound processes beside it (load average $(cut -d' ' -f1-3 /proc/loadavg))"
exit "$status"

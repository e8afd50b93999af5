#!/usr/bin/env bash
# The whole default test suite, as CI runs it (.ci/run):
#   1. scripts/setup.sh --with-bazel
#   2. pytest -m "not slow" over tests/ (two workers, one file per worker at a time)
#   3. bazel test //... : every test file is also a Bazel py_test (tests/BUILD), run here with
#      the same "not slow" selection (--test_tag_filters=-slow for files tagged slow in
#      tests/BUILD, -m "not slow" inside each file), so the targets cannot rot.
# Exits non-zero if either step fails. Extra arguments go to pytest (e.g. -x, -k name).
# Slow tests: .venv/bin/python -m pytest -m slow tests   /   bazel test //...
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
t0=$SECONDS
bash scripts/setup.sh --with-bazel
echo "[test] setup: $((SECONDS - t0)) s"

status=0
t1=$SECONDS
rc=0
.venv/bin/python -m pytest -m "not slow" -n 2 --dist loadfile -q tests "$@" || rc=$?
echo "[test] pytest: $((SECONDS - t1)) s, exit code $rc"
if [[ $rc == 5 ]]; then
  echo "[test] FAIL: pytest collected no tests (exit code 5); that is not a pass" >&2
  status=1
elif [[ $rc != 0 ]]; then
  status=1
fi

t2=$SECONDS
rc=0
(
  # Bazel's py_test runs the python3 first on PATH.
  source .venv/bin/activate
  bazel test //... --test_tag_filters=-slow --test_arg=-m --test_arg="not slow" \
    --show_progress_rate_limit=60 --curses=no
) || rc=$?
echo "[test] bazel test: $((SECONDS - t2)) s, exit code $rc"
[[ $rc == 0 ]] || status=1

echo "[test] total: $((SECONDS - t0)) s; $([[ $status == 0 ]] && echo PASSED || echo FAILED)"
exit $status

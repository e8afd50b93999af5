#!/usr/bin/env bash
# The whole default test suite, as CI runs it (.ci/run):
#   1. scripts/setup.sh --with-bazel
#   2. pytest --collect-only -m "not slow": every test file imports and every test is
#      collected (a collection error fails here, in seconds, with pytest's message); prints
#      the number of tests.
#   3. bazel test //... : every test file is a Bazel py_test (tests/BUILD) that runs pytest
#      on itself with the same "not slow" selection (--test_tag_filters=-slow for files
#      tagged slow in tests/BUILD, -m "not slow" inside each file). This is where the tests
#      run, once each, two files at a time; Bazel caches passing results, so unchanged
#      targets are not re-run on the same machine.
#      (Until 2026-11-23 the suite also ran a second time under pytest-xdist first: the same
#      tests twice, 676 + 898 s of the 1,699 s fresh-clone CI run.)
# Exits non-zero if either step fails. Extra arguments run pytest itself with them first
# (e.g. `bash scripts/test.sh -x -k journal`), then Bazel.
# Slow tests: .venv/bin/python -m pytest -m slow tests   /   bazel test //...
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
t0=$SECONDS
bash scripts/setup.sh --with-bazel
echo "[test] setup: $((SECONDS - t0)) s"

status=0
t1=$SECONDS
rc=0
if [[ $# -gt 0 ]]; then
  .venv/bin/python -m pytest -m "not slow" -n 2 --dist loadfile -q tests "$@" || rc=$?
else
  collected=$(.venv/bin/python -m pytest -m "not slow" --collect-only -q tests 2>&1) || rc=$?
  echo "$collected" | tail -n "$([[ $rc == 0 ]] && echo 1 || echo 40)"
fi
echo "[test] pytest: $((SECONDS - t1)) s, exit code $rc"
if [[ $rc == 5 ]]; then
  echo "[test] FAIL: pytest collected no tests (exit code 5); that is not a pass" >&2
  status=1
elif [[ $rc != 0 ]]; then
  status=1
fi

t2=$SECONDS
rc=0
if ! command -v bazel >/dev/null; then
  echo "[test] FAIL: bazel not found; as root: apt-get install bazel-bootstrap bazel-bootstrap-source" >&2
  rc=127
else
  (
    # Bazel's py_test runs the python3 first on PATH.
    source .venv/bin/activate
    # The venv is not a Bazel input: the setup stamp (hash of setup.py, pyproject.toml) in the
    # test environment makes a changed dependency set re-run the cached test results.
    bazel test //... --test_tag_filters=-slow --test_arg=-m --test_arg="not slow" \
      --test_env=TF_DP_SETUP_STAMP="$(cat .venv/.tf_dp-setup-stamp)" \
      --show_progress_rate_limit=60 --curses=no
  ) || rc=$?
fi
echo "[test] bazel test: $((SECONDS - t2)) s, exit code $rc"
[[ $rc == 0 ]] || status=1

echo "[test] total: $((SECONDS - t0)) s; $([[ $status == 0 ]] && echo PASSED || echo FAILED)"
exit $status

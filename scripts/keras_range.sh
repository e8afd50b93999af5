#!/usr/bin/env bash
# Checks that tf_dp works at both ends of the Keras range that setup.py claims.
#
#   bash scripts/keras_range.sh [extra pytest args]
#
# For each end (KERAS_MIN, then KERAS_MAX) it:
#   1. makes (or reuses) a venv ${TMPDIR:-/tmp}/tf_dp_keras_<version> from python3.11,
#   2. installs the tree editable with its test extras and keras==<version> in ONE pip call, so
#      a Keras that tensorflow-cpu (or anything else we depend on) refuses fails here with pip's
#      conflict message instead of being forced in,
#   3. runs a smoke subset of the fast suite (list below) with that venv and prints the Keras
#      and TensorFlow versions that actually ran.
# Exits non-zero if either end fails (install or tests). Results are recorded in
# docs/keras_versions.md.
#
# Time, per version on 2 cores (-n 2 with pytest-xdist): 4-6 minutes on a quiet machine, up to
# 10-12 with other jobs running; plus about a minute to fill a venv the first time (pip's cache
# makes later fills quick; a venv whose tree, setup.py and version are unchanged is reused).
#
# Environment:
#   KERAS_MIN    default: the lower bound of the "keras>=" line in setup.py
#   KERAS_MAX    default: "latest", the newest keras 3.x release on the package index
#   TF_DP_ROOT   the tree to install and test (default: this script's repository). Handy to test
#                a clean checkout while the working tree is mid-edit:
#                  git worktree add --detach /tmp/keras_range_tree HEAD
#                  TF_DP_ROOT=/tmp/keras_range_tree bash scripts/keras_range.sh
#   PYTHON       the interpreter to build the venvs from (default: python3.11)
set -euo pipefail

SCRIPT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROOT=$(cd "${TF_DP_ROOT:-$SCRIPT_ROOT}" && pwd)
PYTHON=${PYTHON:-python3.11}
VENV_PARENT=${TMPDIR:-/tmp}

# The smoke subset: the private step, DPModel (fit, accumulation, save/load), every optimizer
# wrapper, noise secrecy, and the reparametrized layers. Between them they reach every private
# Keras name tf_dp uses (tf_dp/_internals.py), the most likely thing to break across Keras
# releases. About 260 tests.
SUBSET=(
  tests/core/private_step_test.py
  tests/keras/dp_model_test.py
  tests/optimizers
  tests/privacy/noise_secrecy_test.py
  tests/layers/reparam_dense_test.py
  tests/layers/reparam_einsum_dense_test.py
  tests/layers/reparam_conv2d_test.py
  tests/layers/reparametrize_test.py
)

log() { echo "[keras_range] $*" >&2; }

# pip in a venv; stderr without the warnings about index folders that a machine-wide pip.conf
# may name and that do not exist.
pip_in() {
  local venv=$1 err rc=0
  shift
  err=$(mktemp)
  "$venv/bin/python" -m pip --disable-pip-version-check --no-input "$@" 2>"$err" || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$err" >&2 || true
  rm -f "$err"
  return $rc
}

# The lower bound in setup.py's keras requirement, e.g. "keras>=3.13,<4" -> 3.13.
setup_min() {
  sed -n 's/.*"keras>=\([0-9][0-9.]*\).*/\1/p' "$ROOT/setup.py" | awk 'NR == 1'
}

# The newest keras 3.x on the index (asked with pip, the ordinary client).
latest_keras3() {
  "$PYTHON" -m pip index versions keras 2>/dev/null |
    sed -n 's/^Available versions: //p' | tr ',' '\n' | tr -d ' ' | awk '/^3\./ && !n++'
}

KERAS_MIN=${KERAS_MIN:-$(setup_min)}
KERAS_MAX=${KERAS_MAX:-latest}
if [[ $KERAS_MAX == latest ]]; then
  KERAS_MAX=$(latest_keras3) || KERAS_MAX=
  [[ -n $KERAS_MAX ]] || { log "could not find the newest keras 3.x on the index"; exit 2; }
fi
[[ -n $KERAS_MIN ]] || { log "no keras>= line in $ROOT/setup.py; set KERAS_MIN"; exit 2; }

log "tree: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'not a git tree'))"
log "Keras ends: min $KERAS_MIN, max $KERAS_MAX"

# check_one VERSION: sets RESULT (PASS/FAIL...), RAN (the keras that ran) and SECS.
check_one() {
  local ver=$1 venv="$VENV_PARENT/tf_dp_keras_$1" t0=$SECONDS rc=0 stamp want
  shift
  RESULT=FAIL RAN=- SECS=0

  if ! "$venv/bin/python" -c "import sys" 2>/dev/null; then
    log "[$ver] creating $venv"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
  fi
  # Reinstall only if the dependency set, the tree or the version changed.
  stamp=$venv/.tf_dp-keras-range-stamp
  want=$( (cat "$ROOT/setup.py" "$ROOT/pyproject.toml"; echo "$ROOT $ver") | sha256sum)
  if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    log "[$ver] pip install -e '$ROOT[test]' keras==$ver"
    if ! pip_in "$venv" install -e "$ROOT[test]" "keras==$ver" >"$venv/pip-install.log"; then
      # pip's explanation of a conflict ("The conflict is caused by: ...") goes to stdout.
      grep -A 8 "conflict is caused by" "$venv/pip-install.log" >&2 ||
        tail -n 20 "$venv/pip-install.log" >&2
      log "[$ver] install FAILED: pip cannot install keras==$ver with tf_dp's requirements" \
        "(full log: $venv/pip-install.log)"
      RESULT="FAIL (install)" SECS=$((SECONDS - t0))
      return 0
    fi
    echo "$want" >"$stamp"
  fi

  RAN=$("$venv/bin/python" -c 'import keras; print(keras.__version__)' 2>/dev/null) || RAN=?
  local tf
  tf=$(TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c \
    'import tensorflow; print(tensorflow.__version__)' 2>/dev/null) || tf=?
  log "[$ver] venv runs keras $RAN, tensorflow $tf"
  if [[ $RAN != "$ver" ]]; then
    log "[$ver] FAILED: asked for keras $ver but the venv has $RAN"
    RESULT="FAIL (version)" SECS=$((SECONDS - t0))
    return 0
  fi

  local xdist=()
  if "$venv/bin/python" -c "import xdist" 2>/dev/null; then
    xdist=(-n 2 --dist loadfile)
  fi
  log "[$ver] pytest ${SUBSET[*]}"
  (cd "$ROOT" && "$venv/bin/python" -m pytest -q -x -m "not slow" -p no:cacheprovider \
    --disable-warnings "${xdist[@]}" "${SUBSET[@]}" "$@") || rc=$?
  SECS=$((SECONDS - t0))
  if [[ $rc == 0 ]]; then
    RESULT=PASS
  elif [[ $rc == 5 ]]; then
    RESULT="FAIL (no tests collected)"
  else
    RESULT="FAIL (pytest exit $rc)"
  fi
  log "[$ver] $RESULT in $SECS s"
}

status=0
summary=()
versions=("$KERAS_MIN")
[[ $KERAS_MAX == "$KERAS_MIN" ]] || versions+=("$KERAS_MAX")  # KERAS_MIN=KERAS_MAX=v: one run
for ver in "${versions[@]}"; do
  check_one "$ver" "$@"
  summary+=("keras $ver: $RESULT (ran keras $RAN, $SECS s)")
  [[ $RESULT == PASS ]] || status=1
done

echo "[keras_range] summary ($(date -u +%Y-%m-%dT%H:%MZ), tree $ROOT):"
for line in "${summary[@]}"; do
  echo "[keras_range]   $line"
done
echo "[keras_range] $([[ $status == 0 ]] && echo PASSED || echo FAILED)"
exit $status

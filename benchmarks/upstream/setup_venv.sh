#!/usr/bin/env bash
# Creates the virtualenv for the upstream kfac-jax contestant (idempotent; skipped when present).
#   bash benchmarks/upstream/setup_venv.sh          # -> <repo>/.venv-upstream
# Environment: PYTHON (interpreter for the venv, default python3.11, else python3),
# UPSTREAM_VENV (venv directory), UPSTREAM_FORCE_INSTALL=1 to reinstall anyway.
# Needs pip access to a package index the first time only. Prints the venv's python path last.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${UPSTREAM_VENV:-$ROOT/.venv-upstream}"
PY="$VENV/bin/python"
REQ="$HERE/requirements.txt"
log() { echo "[upstream-venv] $*" >&2; }

# The check runs from / without PYTHONPATH so that this repository's kfac_jax is never imported.
check() {
  (cd / && env -u PYTHONPATH "$PY" -c '
import sys, jax, kfac_jax, optax, numpy
ok = kfac_jax.__version__ == "0.0.8" and jax.__version__ == "0.9.1"
sys.exit(0 if ok else 1)') >/dev/null 2>&1
}

if [[ "${UPSTREAM_FORCE_INSTALL:-0}" != "1" && -x "$PY" ]] && check; then
  log "$VENV is ready (kfac-jax 0.0.8, jax 0.9.1); skipping pip"
else
  if [[ ! -x "$PY" ]]; then
    base="${PYTHON:-}"
    if [[ -z "$base" ]]; then
      if command -v python3.11 >/dev/null 2>&1; then base=python3.11; else base=python3; fi
    fi
    log "creating $VENV with $("$base" --version 2>&1)"
    "$base" -m venv "$VENV"
  fi
  log "pip install -r $REQ into $VENV"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet -r "$REQ"
  if ! check; then
    log "ERROR: $VENV does not import kfac-jax 0.0.8 with jax 0.9.1 after the install"
    exit 1
  fi
fi
echo "$PY"

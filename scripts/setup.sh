#!/usr/bin/env bash
# Shared, idempotent set-up for scripts/test.sh and scripts/demo.sh. Source it (it does not exit):
#   source scripts/setup.sh; kfac_setup_venv examples
# kfac_setup_venv EXTRAS creates .venv (python3 -m venv) if missing and installs the package
# editable with the comma-separated EXTRAS of pyproject.toml (demo.sh: examples; test.sh:
# test,examples). The install is skipped when pyproject.toml has not changed since the last
# successful install, that install covered EXTRAS, and their modules import, so re-runs work
# offline.
# Environment: PYTHON (interpreter used to create .venv, default python3), KFAC_VENV
# (venv directory, default <repo>/.venv), KFAC_FORCE_INSTALL=1 to reinstall anyway.

KFAC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KFAC_VENV="${KFAC_VENV:-$KFAC_ROOT/.venv}"
KFAC_PY="$KFAC_VENV/bin/python"
KFAC_DEFAULT_DATA_DIR="/usr/share/datasets/fashion-mnist"

kfac_log() { echo "[setup] $*" >&2; }

kfac_setup_venv() {
  local base_python="${PYTHON:-python3}"
  if [[ ! -x "$KFAC_PY" ]]; then
    if ! command -v "$base_python" >/dev/null 2>&1; then
      kfac_log "ERROR: '$base_python' not found; install Python >= 3.11 or set PYTHON=/path/to/python3"
      return 1
    fi
    if ! "$base_python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
      kfac_log "ERROR: $("$base_python" --version 2>&1) is too old; kfac_jax needs Python >= 3.11 (set PYTHON=...)"
      return 1
    fi
    kfac_log "creating $KFAC_VENV with $("$base_python" --version 2>&1)"
    "$base_python" -m venv "$KFAC_VENV" || return 1
  fi

  local extras="${1:-examples}"
  local stamp="$KFAC_VENV/.kfac_jax_install_stamp"
  local want
  want="$("$KFAC_PY" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$KFAC_ROOT/pyproject.toml")" || return 1
  # The stamp holds the hash of pyproject.toml and the extras installed with it.
  local have_hash="" have_extras=""
  if [[ -f "$stamp" ]]; then
    read -r have_hash have_extras < "$stamp" || true
  fi
  local all="$extras"
  if [[ "$have_hash" == "$want" && -n "$have_extras" ]]; then
    all="$have_extras,$extras"
  fi
  all="$(echo "$all" | tr ',' '\n' | sort -u | paste -sd, -)"
  local modules="kfac_jax jax optax"
  case ",$all," in *,examples,*) modules="$modules flax tqdm matplotlib sklearn" ;; esac
  case ",$all," in *,test,*) modules="$modules pytest xdist chex orbax.checkpoint haiku equinox sphinx" ;; esac
  if [[ "${KFAC_FORCE_INSTALL:-0}" != "1" && "$have_hash" == "$want" && "$all" == "$have_extras" ]] \
      && (cd / && "$KFAC_PY" -c "import ${modules// /, }" >/dev/null 2>&1); then
    kfac_log "$KFAC_VENV is up to date (pyproject.toml unchanged, extras $have_extras); skipping pip install"
  else
    kfac_log "pip install -e \".[$all]\" into $KFAC_VENV"
    (cd "$KFAC_ROOT" && "$KFAC_PY" -m pip install --quiet -e ".[$all]") || return 1
    echo "$want $all" > "$stamp"
  fi
}

# Installs the Debian package dataset-fashion-mnist, but only when the files are missing,
# KFAC_DATA_DIR is not set, we are root, and apt-get exists. Never fails.
# Usage: kfac_maybe_install_dataset [--update]
kfac_maybe_install_dataset() {
  if [[ -n "${KFAC_DATA_DIR:-}" ]]; then
    return 0
  fi
  if [[ -e "$KFAC_DEFAULT_DATA_DIR/train-images-idx3-ubyte.gz" || -e "$KFAC_DEFAULT_DATA_DIR/train-images-idx3-ubyte" ]]; then
    return 0
  fi
  if [[ "$(id -u)" != "0" ]] || ! command -v apt-get >/dev/null 2>&1; then
    kfac_log "Fashion-MNIST not found in $KFAC_DEFAULT_DATA_DIR (not root or no apt-get);" \
             "the demo will fall back to scikit-learn's digits. Install with" \
             "'sudo apt-get install dataset-fashion-mnist' or set KFAC_DATA_DIR."
    return 0
  fi
  kfac_log "installing Debian package dataset-fashion-mnist"
  if [[ "${1:-}" == "--update" ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || kfac_log "apt-get update failed (ignored)"
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >&2 \
    || kfac_log "could not install dataset-fashion-mnist (ignored; the digits fallback will be used)"
  return 0
}

kfac_print_versions() {
  "$KFAC_PY" -c 'import sys, os, jax; print(f"[setup] python {sys.version.split()[0]} ({sys.executable}), jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs", file=sys.stderr)'
}

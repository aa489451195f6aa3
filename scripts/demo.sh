#!/usr/bin/env bash
# Set up .venv with the examples extra (idempotent), install the Fashion-MNIST Debian package when possible (root and
# apt-get), then train K-FAC vs Adam on the deep autoencoder and write autoencoder.png.
# Arguments go to examples/autoencoder.py, e.g. `bash scripts/demo.sh --steps 100`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
kfac_setup_venv examples
kfac_maybe_install_dataset --update
kfac_print_versions
exec "$KFAC_PY" "$KFAC_ROOT/examples/autoencoder.py" "$@"

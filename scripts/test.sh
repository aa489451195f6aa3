#!/usr/bin/env bash
# Set up .venv with the test and examples extras (idempotent) and run the whole test suite with 2 xdist workers.
# `--dist worksteal` hands each worker a contiguous half of the tests (a file's tests mostly stay in
# one process, which compiles their shared programs once) and rebalances by stealing at the end.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k scanner`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$KFAC_ROOT"
kfac_setup_venv test,examples
kfac_maybe_install_dataset
kfac_print_versions
exec "$KFAC_PY" -m pytest -n 2 --dist worksteal tests "$@"

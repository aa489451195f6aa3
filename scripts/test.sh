#!/usr/bin/env bash
# Set up .venv with the test and examples extras (idempotent) and run the whole test suite with 2 xdist workers.
# `--dist worksteal` hands each worker a contiguous half of the tests (a file's tests mostly stay in
# one process, which compiles their shared programs once) and rebalances by stealing at the end.
# Then, with no arguments, the tests marked `numerics` (float64 references) run again with XLA's
# optimizations on (KFAC_TEST_XLA_OPT=1, what users run; the suite turns most of them off to
# compile faster). Extra arguments go to pytest for the first run only, e.g.
# `bash scripts/test.sh -k scanner`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$KFAC_ROOT"
kfac_setup_venv test,examples
kfac_maybe_install_dataset
kfac_print_versions
"$KFAC_PY" -m pytest -n 2 --dist worksteal tests "$@"
if [[ $# -eq 0 ]]; then
  KFAC_TEST_XLA_OPT=1 "$KFAC_PY" -m pytest -n 2 --dist worksteal -m numerics -q tests
fi

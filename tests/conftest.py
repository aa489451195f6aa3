"""Test configuration: 8 fake CPU devices and most XLA optimisations off, set before JAX starts.

Rank promotion stays allowed globally (user models write `x @ w + b`); test_strict_numerics runs
the library's own code under `jax_numpy_rank_promotion="raise"`.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most XLA optimisation passes off: the suite is compile-bound (hundreds of tiny programs, each
# run a few times), and this cuts its time by about a fifth. Numerics are checked against exact
# computations with tolerances, which hold either way; the scripts the suite starts in a
# subprocess inherit it. `KFAC_TEST_XLA_OPT=1` keeps the optimisations (what users run).
if os.environ.get("KFAC_TEST_XLA_OPT", "0") != "1":
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def x64():
  """Runs a test with float64 enabled (restored afterwards)."""
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", prev)

"""Test configuration: 8 fake CPU devices, set before JAX starts.

Rank promotion stays allowed globally (user models write `x @ w + b`); test_strict_numerics runs
the library's own code under `jax_numpy_rank_promotion="raise"`.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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

"""`kfac_jax._compat`: the one place JAX internals and jaxlib's CPU LAPACK threads are touched."""

import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import json, threadpoolctl
from scipy.linalg import cython_lapack  # The LAPACK jaxlib calls, loaded.
import jax, jax.numpy as jnp, optax
import kfac_jax

def threads():
  out = {}
  for lib in threadpoolctl.threadpool_info():
    if lib["internal_api"] == "openblas":
      out["scipy" if "scipy.libs" in lib["filepath"] else "numpy"] = lib["num_threads"]
  return out

params = {"w": jnp.ones((3, 2))}
batch = jnp.ones((4, 3))
def loss_fn(p, x):
  y = x @ p["w"]
  kfac_jax.register_squared_error_loss(y)
  return 0.5 * jnp.sum(y**2) / x.shape[0]

before = threads()
if FRONT == "kernel":  # The kernel's solve, traced (not built by an estimator).
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact")
  rows = kfac_jax.kernel.rows(reg, params, batch)
  jax.eval_shape(lambda r: kfac_jax.kernel.direction(r, params, damping=1.0), rows)
else:
  kfac_jax.kfac(loss_fn, batch).init(params)
print(json.dumps({"before": before, "after": threads()}))
"""


def _probe(front="kfac", **env_vars):
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
  }
  env.update(env_vars, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, "-c", f"FRONT = {front!r}\n" + _PROBE],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("front", ["kfac", "kernel"])
def test_cpu_lapack_runs_on_one_openblas_thread_without_an_environment_variable(front):
  """K-FAC's estimator and the kernel's eigendecomposition both run jaxlib's CPU LAPACK."""
  pytest.importorskip("threadpoolctl")
  got = _probe(front)
  if "scipy" not in got["after"]:
    pytest.skip("scipy here does not ship its own OpenBLAS")
  assert got["after"]["scipy"] == 1, got
  assert got["after"].get("numpy") == got["before"].get("numpy"), got  # numpy's is untouched.


def test_a_thread_count_in_the_environment_is_kept():
  pytest.importorskip("threadpoolctl")
  got = _probe(OPENBLAS_NUM_THREADS="2")
  if "scipy" not in got["after"]:
    pytest.skip("scipy here does not ship its own OpenBLAS")
  assert got["after"]["scipy"] == 2, got

"""Compile-time breakdown of the autoencoder K-FAC step (trace+lower vs XLA compile, per part).

python benchmarks/profile/compile_breakdown.py
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import jax
import jax.numpy as jnp
import optax

import kfac_jax
from examples import autoencoder as ae


def timed_compile(name, f, *args):
  t0 = time.perf_counter()
  lowered = jax.jit(f).lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  print(
    f"{name:34s} trace+lower {t1 - t0:6.3f}s  compile {t2 - t1:6.3f}s  total {t2 - t0:6.3f}s",
    flush=True,
  )
  return compiled


def main():
  model = ae.make_model()
  params = ae.init_params(model)
  loss_fn = ae.make_loss_fn(model)
  batch = jnp.zeros((1000, 784), jnp.float32)
  rng = jax.random.PRNGKey(0)
  jax.jit(lambda x: x + 1)(1.0)
  adam = optax.adam(1e-3)
  timed_compile(
    "adam step", ae.make_adam_step(loss_fn, adam), params, adam.init(params), batch, rng
  )
  tx = ae.make_kfac(loss_fn, batch)
  st = tx.init(params)
  timed_compile("kfac step", ae.make_kfac_step(loss_fn, tx), params, st, batch, rng)
  timed_compile("jax.value_and_grad", jax.value_and_grad(loss_fn), params, batch)
  timed_compile("kfac value_and_grad", kfac_jax.value_and_grad(loss_fn), params, batch, rng)
  est = kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch))
  es = est.init(params)
  stats = jax.eval_shape(kfac_jax.value_and_grad(loss_fn), params, batch, rng)[2]
  timed_compile(
    "update_curvature_from_stats",
    lambda s, st: est.update_curvature_from_stats(s, st, 0.95),
    es,
    stats,
  )
  timed_compile("update_inverses", lambda s: est.update_inverses(s, 30.0), es)
  timed_compile("multiply_inverse", est.multiply_inverse, es, params)


if __name__ == "__main__":
  main()

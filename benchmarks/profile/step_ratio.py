"""Median K-FAC and Adam autoencoder step (ms) and their ratio, in one process.

For A/B runs of two checkouts in alternation: run it from each checkout's root. The state is
donated and every output awaited each step, as in the benchmark harness.

    python benchmarks/profile/step_ratio.py
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())
import jax
import jax.numpy as jnp
import optax

from examples import autoencoder as ae

model = ae.make_model()
params = ae.init_params(model)
loss_fn = ae.make_loss_fn(model)
x = jax.random.uniform(jax.random.key(0), (1000, 784))
rng = jax.random.PRNGKey(0)
res = {}
for name, tx, mk in (
  ("adam", optax.adam(1e-3), ae.make_adam_step),
  ("kfac", ae.make_kfac(loss_fn, x), ae.make_kfac_step),
):
  st = tx.init(params)
  copy = lambda t: jax.tree_util.tree_map(jnp.copy, t)  # Donation deletes the arguments.
  c = (
    jax.jit(mk(loss_fn, tx), donate_argnums=(0, 1)).lower(copy(params), copy(st), x, rng).compile()
  )
  p, s = copy(params), st
  ts = []
  for i in range(60):
    t0 = time.perf_counter()
    p, s, l = c(p, s, x, rng)
    jax.block_until_ready((p, s, l))
    ts.append(time.perf_counter() - t0)
  res[name] = np.median(ts[5:]) * 1e3
print(
  os.getcwd(), {k: round(v, 1) for k, v in res.items()}, "ratio %.2f" % (res["kfac"] / res["adam"])
)

"""Step-time breakdown of the autoencoder K-FAC step: each piece jitted and timed on its own.

python benchmarks/profile/step_breakdown.py [BATCH]     # BATCH rows, default 1000
"""

import sys
import time

sys.path.insert(
  0,
  __import__("os").path.dirname(
    __import__("os").path.dirname(
      __import__("os").path.dirname(__import__("os").path.abspath(__file__))
    )
  ),
)
import jax
import jax.numpy as jnp
import numpy as np

import kfac_jax
from examples import autoencoder as ae

model = ae.make_model()
params = ae.init_params(model)
loss_fn = ae.make_loss_fn(model)
rng = np.random.default_rng(0)
batch = jnp.asarray(
  rng.uniform(size=(int(sys.argv[1]) if len(sys.argv) > 1 else 1000, 784)).astype(np.float32)
)
key = jax.random.key(0)
est = kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch))
es = est.init(params)
vag = kfac_jax.value_and_grad(loss_fn)
_, grads, stats = jax.jit(vag)(params, batch, key)
es = jax.jit(lambda s, st: est.update_curvature_from_stats(s, st, 0.95))(es, stats)
es = jax.jit(lambda s: est.update_inverses(s, 30.0))(es)


def t(name, f, *args):
  c = jax.jit(f).lower(*args).compile()
  jax.block_until_ready(c(*args))
  ts = []
  for _ in range(9):
    t0 = time.perf_counter()
    jax.block_until_ready(c(*args))
    ts.append(time.perf_counter() - t0)
  print(f"{name:28s} {1e3 * np.median(ts):7.1f} ms  {c.cost_analysis()['flops'] / 1e9:5.1f} GFLOP")


t("jax.value_and_grad", jax.value_and_grad(loss_fn), params, batch)
t("kfac value_and_grad", vag, params, batch, key)
t("batch_factors", lambda st: est.batch_factors(st), stats)
t(
  "update_curvature_from_stats",
  lambda s, st: est.update_curvature_from_stats(s, st, 0.95),
  es,
  stats,
)
t("multiply_inverse", est.multiply_inverse, es, grads)
t("update_inverses", lambda s: est.update_inverses(s, 30.0), es)

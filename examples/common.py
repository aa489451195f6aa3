"""The training loop shared by the classifier and language-model examples."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax
from examples import autoencoder as ae


def train(
  name: str,
  tx,
  loss_fn: Callable,
  params,
  batch_at: Callable[[int], dict],
  steps: int,
  seed: int,
  progress: bool,
  loss_scale: float = 1.0,
):
  """Jitted steps of `tx` on `batch_at(t)`, timed; K-FAC when `name` starts with "K-FAC".

  K-FAC steps take loss, gradient and curvature statistics from one `kfac_jax.value_and_grad`
  pass; other optimizers use `jax.value_and_grad`. Returns `(RunResult, final params)`; the
  recorded losses are multiplied by `loss_scale` (e.g. 1/length for nats per character).
  """
  from tqdm.auto import tqdm

  is_kfac = name.startswith("K-FAC")

  def step(params, state, batch, rng):
    if is_kfac:
      loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
      updates, state = tx.update(grads, state, params, curvature_stats=stats)
    else:
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state = tx.init(params)
  rng = jax.random.key(seed + 1)
  first = jax.tree_util.tree_map(jnp.asarray, batch_at(0))
  t0 = time.perf_counter()
  compiled = jax.jit(step).lower(params, state, first, rng).compile()
  compile_time = time.perf_counter() - t0
  losses, times = [], []
  for t in tqdm(
    range(steps), desc=f"{name:>5}", disable=not progress, mininterval=0.5, file=sys.stderr
  ):
    batch = jax.tree_util.tree_map(jax.device_put, batch_at(t))
    rng, sub = jax.random.split(rng)
    start = time.perf_counter()
    params, state, loss = compiled(params, state, batch, sub)
    jax.block_until_ready((params, loss))
    times.append(time.perf_counter() - start)
    losses.append(float(loss) * loss_scale)
  result = ae.RunResult(
    name=name,
    losses=np.asarray(losses),
    step_times=np.asarray(times),
    compile_time=compile_time,
    final_loss=float("nan"),
  )
  return result, params

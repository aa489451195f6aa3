"""Trace+lower time of jitted K-FAC steps (no XLA compile) and how often each trace traces
loss_fn: python benchmarks/profile/trace_time.py [shared]  (shared: one kfac_jax.Registration)."""

import sys
import time

import jax
import jax.numpy as jnp
import optax

import kfac_jax


def mlp(sizes):
  def init(key):
    p = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
      key, k = jax.random.split(key)
      p[f"l{i}"] = {"w": jax.random.normal(k, (a, b)) / a**0.5, "b": jnp.zeros(b)}
    return p

  def loss_fn(p, batch):
    CALLS.append(1)
    x = batch["x"]
    for i in range(len(sizes) - 1):
      x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
      if i < len(sizes) - 2:
        x = jnp.tanh(x)
    kfac_jax.register_softmax_cross_entropy_loss(x, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(x, batch["y"]).mean()

  return init, loss_fn


CALLS = []


def timeit(f, *args, n=7):
  ts = []
  for _ in range(n):
    g = jax.jit(lambda *a: f(*a))  # a fresh function: a fresh trace
    t0 = time.perf_counter()
    g.lower(*args)
    ts.append(time.perf_counter() - t0)
  ts.sort()
  return ts[len(ts) // 2]


def main():
  shared = len(sys.argv) > 1 and sys.argv[1] == "shared"
  init, loss_fn = mlp((32,) + (64,) * 8 + (10,))
  params = init(jax.random.key(0))
  batch = {"x": jnp.ones((64, 32)), "y": jnp.zeros(64, jnp.int32)}
  rng = jax.random.key(1)
  if shared:
    reg = kfac_jax.Registration(loss_fn, params, batch)
    tx = kfac_jax.kfac(registration=reg, learning_rate=0.1)
    vg = kfac_jax.value_and_grad(registration=reg)
    opt = kfac_jax.Optimizer(registration=reg)
  else:
    tx = kfac_jax.kfac(loss_fn, batch, 0.1)
    vg = kfac_jax.value_and_grad(loss_fn)
    opt = kfac_jax.Optimizer(loss_fn, batch)
  st = tx.init(params)

  def step(p, s, b, r):
    loss, g, stats = vg(p, b, r)
    u, s = tx.update(g, s, p, curvature_stats=stats)
    return optax.apply_updates(p, u), s, loss

  ost = opt.init(params)
  for name, f, args in [
    ("value_and_grad + kfac.update", step, (params, st, batch, rng)),
    (
      "kfac.update(batch=)",
      lambda p, s, b, r: tx.update(p, s, p, batch=b, rng=r),
      (params, st, batch, rng),
    ),
    ("Optimizer.step", opt.step, (params, ost, batch, rng)),
  ]:
    c = len(CALLS)
    t = timeit(f, *args)
    c = (len(CALLS) - c) / 7
    print(
      f"{name:32s} trace+lower median {1e3 * t:7.1f} ms, loss_fn traces per step trace {c:.0f}",
      flush=True,
    )


main()

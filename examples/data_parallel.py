"""Data-parallel K-FAC with `jax.pmap` on fake CPU devices, checked against one device.

Sets `--xla_force_host_platform_device_count` before importing JAX (so it runs on any laptop),
splits each minibatch of an MLP classifier on Fashion-MNIST over the devices, and trains with
`kfac_jax.kfac(..., axis_name="batch")`: curvature statistics are averaged over the devices and
the inverse work is split between them. The same run on one device with the whole minibatch
gives the same parameters (empirical Fisher, so nothing random differs; the printed difference
is float32 round-off). Writes a PNG of the
loss of both runs.

    python examples/data_parallel.py               # 8 devices, ~1 minute on 2 CPU cores
    python examples/data_parallel.py --devices 4 --fast
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
  _n = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), None)
  if _n is None and "--devices" in sys.argv:
    _n = sys.argv[sys.argv.index("--devices") + 1]
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n or 8}"
  ).strip()

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from examples import autoencoder as ae  # noqa: E402
from examples import data as data_lib  # noqa: E402


def mlp_init(key, sizes):
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, k = jax.random.split(key)
    params[f"dense{i}"] = {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
  return params


def loss_fn(params, batch):
  x = batch["x"]
  n = len(params)
  for i in range(n):
    x = x @ params[f"dense{i}"]["w"] + params[f"dense{i}"]["b"]
    if i < n - 1:
      x = jnp.tanh(x)
  kfac_jax.register_softmax_cross_entropy_loss(x, batch["y"])
  return optax.softmax_cross_entropy_with_integer_labels(x, batch["y"]).mean()


# The empirical Fisher draws nothing at random, so the two runs must agree to round-off. With
# the default sampled Fisher the devices draw their own targets and the runs differ by sampling
# noise only.
MODE = "empirical"


def make_tx(reg, axis_name=None):
  return kfac_jax.kfac(
    registration=reg,
    learning_rate=0.2,
    momentum=0.9,
    damping=0.1,
    inverse_every=5,
    axis_name=axis_name,
  )


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--steps", type=int, default=None, help="default 100 (10 with --fast)")
  p.add_argument("--batch-size", type=int, default=512)
  p.add_argument("--out", default="data_parallel.png")
  p.add_argument("--fast", action="store_true")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--data-dir", default=None)
  args = p.parse_args(argv)
  from tqdm.auto import tqdm

  steps = args.steps or (10 if args.fast else 100)
  n = jax.local_device_count()
  if args.batch_size % n:
    p.error(f"--batch-size {args.batch_size} is not a multiple of the {n} devices")
  ds = data_lib.load_dataset("fashion_mnist", args.data_dir)
  sizes = (ds.num_features, 64 if args.fast else 256, 10)
  params0 = mlp_init(jax.random.key(0), sizes)
  idx = ae.batch_indices(ds.num_examples, args.batch_size, steps, 0)

  def batch_at(t):
    return {"x": jnp.asarray(ds.train_images[idx[t]]), "y": jnp.asarray(ds.train_labels[idx[t]])}

  def shard(b):
    return jax.tree_util.tree_map(lambda x: x.reshape((n, -1) + x.shape[1:]), b)

  # pmap: each device sees batch_size / n examples.
  example = jax.tree_util.tree_map(lambda x: x[0], shard(batch_at(0)))
  reg_p = kfac_jax.Registration(loss_fn, params0, example, estimation_mode=MODE)
  tx_p = make_tx(reg_p, axis_name="batch")

  def pstep(params, state, batch, rng):
    loss, grads, stats = kfac_jax.value_and_grad(registration=reg_p)(params, batch, rng)
    grads, loss = jax.lax.pmean((grads, loss), "batch")
    updates, state = tx_p.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  # One device, whole batch: the reference.
  reg_1 = kfac_jax.Registration(loss_fn, params0, batch_at(0), estimation_mode=MODE)
  tx_1 = make_tx(reg_1)

  @jax.jit
  def step1(params, state, batch, rng):
    loss, grads, stats = kfac_jax.value_and_grad(registration=reg_1)(params, batch, rng)
    updates, state = tx_1.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  pfn = jax.pmap(pstep, axis_name="batch", in_axes=(0, 0, 0, None))
  rep = lambda tree: jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)
  p_par, s_par = rep(params0), rep(tx_p.init(params0))
  p_one, s_one = params0, tx_1.init(params0)
  losses_par, losses_one = [], []
  print(
    f"{n} devices, batch {args.batch_size} ({args.batch_size // n} per device), "
    f"MLP {sizes}, {steps} steps; data: {ds.source}"
  )
  for t in tqdm(range(steps), disable=args.no_progress, file=sys.stderr, mininterval=0.5):
    b, key = batch_at(t), jax.random.key(t)
    p_par, s_par, loss = pfn(p_par, s_par, shard(b), key)
    losses_par.append(float(loss[0]))
    p_one, s_one, loss = step1(p_one, s_one, b, key)
    losses_one.append(float(loss))
  diff = max(
    float(jnp.max(jnp.abs(a[0] - b)))
    for a, b in zip(jax.tree_util.tree_leaves(p_par), jax.tree_util.tree_leaves(p_one))
  )
  scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree_util.tree_leaves(p_one))
  print(f"final loss: {n} devices {losses_par[-1]:.4f}, one device {losses_one[-1]:.4f}")
  print(f"max |params difference| / max |params|: {diff / scale:.2e}")
  results = [
    ae.RunResult(
      f"K-FAC, {n} devices", np.asarray(losses_par), np.ones(steps), 0.0, losses_par[-1]
    ),
    ae.RunResult("K-FAC, 1 device", np.asarray(losses_one), np.ones(steps), 0.0, losses_one[-1]),
  ]
  ae.plot(results, args.out, f"data-parallel K-FAC ({n} fake CPU devices) vs one device")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

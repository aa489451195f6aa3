"""A small CNN classifier on Fashion-MNIST: K-FAC (conv + LayerNorm + dense blocks) against Adam.

Two 3x3 convolutions with LayerNorm, ReLU and average pooling, then a dense classifier; softmax
cross-entropy. The scanner finds the convolutions (KFC blocks), the LayerNorm scales and shifts
(full blocks) and the dense layer (Kronecker block) without any manual tag; the summary table is
printed first. Both optimizers start from the same initialisation and see the same minibatches.
Prints held-out loss and accuracy and writes a PNG of the training loss against steps and
against seconds.

    python examples/cnn.py                 # ~1-2 minutes on 2 CPU cores
    python examples/cnn.py --fast          # a few steps on a tiny subset (used by the tests)
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from examples import autoencoder as ae  # noqa: E402
from examples import common  # noqa: E402
from examples import data as data_lib  # noqa: E402


class CNN(nn.Module):
  channels: tuple[int, ...] = (16, 32)
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    for c in self.channels:
      x = nn.Conv(c, (3, 3), padding="SAME")(x)
      x = nn.LayerNorm()(x)
      x = nn.relu(x)
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    return nn.Dense(self.classes)(x.reshape(x.shape[0], -1))


def make_loss_fn(model):
  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return loss_fn


def evaluate(model, loss_fn, params, data) -> tuple[float, float]:
  logits = jax.jit(model.apply)(params, jnp.asarray(data["x"]))
  loss = float(jax.jit(loss_fn)(params, {k: jnp.asarray(v) for k, v in data.items()}))
  return loss, float(np.mean(np.argmax(np.asarray(logits), -1) == data["y"]))


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--steps", type=int, default=None, help="default 150 (8 with --fast)")
  p.add_argument("--batch-size", type=int, default=None, help="default 256 (64 with --fast)")
  p.add_argument("--kfac-lr", type=float, default=0.3)
  p.add_argument("--kfac-momentum", type=float, default=0.7)
  p.add_argument("--damping", type=float, default=0.1)
  p.add_argument("--adam-lr", type=float, default=2e-3)
  p.add_argument("--inverse-every", type=int, default=5)
  p.add_argument("--data-dir", default=None)
  p.add_argument("--out", default="cnn.png", help="PNG path for the curves")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--fast", action="store_true", help="a few steps on a tiny subset")
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  args.steps = args.steps or (8 if args.fast else 150)
  args.batch_size = args.batch_size or (64 if args.fast else 256)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  ds = data_lib.load_dataset("fashion_mnist", args.data_dir)
  h, w = ds.image_shape
  x = ds.train_images.reshape(-1, h, w, 1)
  held_out = 500 if args.fast else 5000
  train = {"x": x[:-held_out], "y": ds.train_labels[:-held_out]}
  test = {"x": x[-held_out:], "y": ds.train_labels[-held_out:]}
  model = CNN(channels=(4, 8) if args.fast else (16, 32))
  params = jax.jit(model.init)(jax.random.key(args.seed), train["x"][:1])
  loss_fn = make_loss_fn(model)
  idx = ae.batch_indices(train["y"].shape[0], args.batch_size, args.steps, args.seed)
  example = {k: jnp.asarray(v[idx[0]]) for k, v in train.items()}
  print(f"data: {ds.source}")
  print(kfac_jax.summary(loss_fn, params, example))
  kfac_tx = kfac_jax.kfac(
    loss_fn,
    example,
    learning_rate=args.kfac_lr,
    momentum=args.kfac_momentum or None,
    damping=args.damping,
    inverse_every=args.inverse_every,
  )
  results = []
  print("| optimizer | held-out loss | held-out accuracy | median step (ms) | compile (s) |")
  print("|---|---:|---:|---:|---:|")
  for name, tx in (("K-FAC", kfac_tx), ("Adam", optax.adam(args.adam_lr))):
    r, final = common.train(
      name,
      tx,
      loss_fn,
      params,
      lambda t: {k: v[idx[t]] for k, v in train.items()},
      args.steps,
      args.seed,
      not args.no_progress,
    )
    loss, acc = evaluate(model, loss_fn, final, test)
    r.final_loss = loss
    results.append(r)
    if not np.isfinite(loss):
      print(f"{name}: non-finite loss")
    print(
      f"| {name} | {loss:.4f} | {acc:.3f} | {1e3 * r.median_step_time:.1f} | {r.compile_time:.2f} |"
    )
  ae.plot(results, args.out, f"CNN on {ds.name}, batch {args.batch_size}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

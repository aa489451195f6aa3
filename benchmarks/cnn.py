"""Benchmark: a small CNN classifier on Fashion-MNIST, every optimizer in one run.

The model of `examples/cnn.py`: two 3x3 convolutions (16 and 32 channels), each followed by
LayerNorm, ReLU and 2x2 average pooling, then a dense classifier; softmax cross-entropy averaged
over the batch. The scanner finds the convolutions (Kronecker-factored conv blocks), the
LayerNorm scales and shifts and the dense layer without manual tags. Contestants as in
`benchmarks/autoencoder.py` (Adam grid, SGD+momentum, the kfac_jax transform and Optimizer,
upstream kfac-jax 0.0.8 with `--with-upstream`); what is measured: `benchmarks/_harness.py`.
Minibatches of `--batch-size` from the first 55,000 training images; the loss is evaluated on the
last 5,000.

    python benchmarks/cnn.py
    python benchmarks/cnn.py --with-upstream --json out/cnn.json
    python benchmarks/cnn.py --quick              # a few steps of a tiny CNN
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _harness  # noqa: E402
from examples import autoencoder as ae  # noqa: E402
from examples import cnn as cnn_lib  # noqa: E402
from examples import data as data_lib  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  _harness.add_common_args(
    p,
    steps=100,
    warmup=5,
    adam_lrs="2e-3,5e-3,1e-2,2e-2",
    sgd_lr=0.01,
    kfac_lr=0.2,
    kfac_momentum=0.9,
    damping=1.0,
    optimizer_damping=1.0,
    inverse_every=10,
    plot=os.path.join("out", "bench_cnn.png"),
  )
  p.add_argument("--batch-size", type=int, default=256)
  p.add_argument("--channels", default="16,32", help="conv channels, comma-separated")
  p.add_argument("--data-dir", default=None, help="MNIST-format idx files (see examples/data.py)")
  args = p.parse_args(argv)
  if args.quick:
    args.steps, args.warmup, args.compile_repeats = min(args.steps, 6), min(args.warmup, 1), 1
    args.batch_size, args.channels = min(args.batch_size, 64), "4,8"
  _harness.check_common_args(p, args)
  try:
    args.channel_list = tuple(int(c) for c in args.channels.split(","))
  except ValueError:
    p.error(f"--channels must be comma-separated integers, got {args.channels!r}")
  if args.batch_size < 1 or not args.channel_list or min(args.channel_list) < 1:
    p.error(
      f"--batch-size and every --channels entry must be >= 1, got {args.batch_size} and "
      f"{args.channels!r}"
    )
  return args


def make_workload(args) -> _harness.Workload:
  ds = data_lib.load_dataset("fashion_mnist", args.data_dir)
  h, w = ds.image_shape
  if h % 2 ** len(args.channel_list) or w % 2 ** len(args.channel_list):
    raise ValueError(
      f"--channels {args.channels!r}: {len(args.channel_list)} 2x2 poolings do "
      f"not divide the {h}x{w} images; use fewer convolutions."
    )
  x = ds.train_images.reshape(-1, h, w, 1)
  y = ds.train_labels.astype(np.int32)
  if args.quick:
    x, y = x[:768], y[:768]
  held_out = 256 if args.quick else 5000
  train = {"x": x[:-held_out], "y": y[:-held_out]}
  test = {"x": jnp.asarray(x[-held_out:]), "y": jnp.asarray(y[-held_out:])}
  model = cnn_lib.CNN(channels=args.channel_list)
  params0 = jax.jit(model.init)(jax.random.key(args.seed), train["x"][:1])
  loss_fn = cnn_lib.make_loss_fn(model)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params0))
  total = args.warmup + args.steps
  idx = ae.batch_indices(train["y"].shape[0], args.batch_size, total, args.seed)
  eval_loss = jax.jit(loss_fn)
  return _harness.Workload(
    name="cnn",
    description=f"CNN conv{args.channel_list}+LayerNorm+dense ({n_params:,} parameters) on "
    f"{ds.name}, batch {idx.shape[1]}; data: {ds.source}",
    loss_fn=loss_fn,
    params0=params0,
    batch_at=lambda t: {k: v[idx[t]] for k, v in train.items()},
    eval_fn=lambda params: float(eval_loss(params, test)),
    eval_description=f"softmax cross-entropy, mean over {held_out} held-out training images",
    upstream={"model": "cnn", "num_convs": len(args.channel_list)},
    upstream_data=lambda steps: (train, idx[:steps]),
  )


def main(argv=None) -> int:
  return _harness.main(parse_args, make_workload, __file__, argv)


if __name__ == "__main__":
  sys.exit(main())

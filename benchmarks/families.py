"""Two more model families on Fashion-MNIST, for step sweeps and races: a ViT and an LSTM.

`--model vit`: the 28x28 image cut into 7x7 patches (16 tokens of 49 pixels), a dense patch
embedding, a learned positional table, `--layers` pre-LayerNorm Transformer blocks (Flax
`MultiHeadDotProductAttention`, a GELU MLP of width 2d), mean pooling and a dense classifier.
`--model rnn`: the image read row by row (28 steps of 28 pixels) by `nn.RNN` over a Flax
`OptimizedLSTMCell` (its four gate kernels concatenated before one product), the last hidden
state into a dense classifier. Both: softmax cross-entropy averaged over the batch, minibatches
of `--batch-size` from the first 55,000 training images, evaluated on the last 5,000.
Contestants and measurements as in `benchmarks/cnn.py` (`benchmarks/_harness.py`); no upstream
version. `benchmarks/step_sweep.py --workload vit|rnn` sweeps `kfac_jax.kfac` settings on them.

    python benchmarks/families.py --model vit
    python benchmarks/families.py --model rnn --quick
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

from benchmarks import _harness  # noqa: E402
from examples import autoencoder as ae  # noqa: E402
from examples import cnn as cnn_lib  # noqa: E402
from examples import data as data_lib  # noqa: E402

PATCH = 7


def patch_tokens(module: nn.Module, x, width: int):
  """Inside `module`'s compact call: the images' PATCH x PATCH patches as `width`-wide tokens
  (a Dense layer) plus a learned positional table, the parameter "pos"."""
  b, h, w = x.shape[0], x.shape[1] // PATCH, x.shape[2] // PATCH
  patches = x.reshape(b, h, PATCH, w, PATCH).transpose(0, 1, 3, 2, 4).reshape(b, h * w, -1)
  tokens = nn.Dense(width)(patches)
  return tokens + module.param("pos", nn.initializers.normal(0.02), (1, h * w, width))


class ViT(nn.Module):
  """Patches → tokens, positional table, pre-norm blocks, mean pool, classifier."""

  width: int = 64
  layers: int = 2
  heads: int = 4
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    tokens = patch_tokens(self, x, self.width)
    for _ in range(self.layers):
      tokens = tokens + nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(tokens))
      y = nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(tokens)))
      tokens = tokens + nn.Dense(self.width)(y)
    return nn.Dense(self.classes)(nn.LayerNorm()(tokens).mean(axis=1))


class RowLSTM(nn.Module):
  """Rows as time steps through an `OptimizedLSTMCell`; the last hidden state is classified."""

  hidden: int = 128
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    seq = x.reshape(x.shape[0], x.shape[1], -1)  # [B, rows, pixels per row]
    y = nn.RNN(nn.OptimizedLSTMCell(self.hidden))(seq)
    return nn.Dense(self.classes)(y[:, -1])


MODELS = ("vit", "rnn")


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  _harness.add_common_args(
    p,
    steps=100,
    warmup=5,
    adam_lrs="1e-3,3e-3,1e-2",
    sgd_lr=0.05,
    kfac_lr=0.3,
    kfac_momentum=0.7,
    damping=0.1,
    optimizer_damping=1.0,
    inverse_every=5,
    plot="",
  )
  p.add_argument("--model", choices=MODELS, default="vit")
  p.add_argument("--batch-size", type=int, default=256)
  p.add_argument("--width", type=int, default=None, help="ViT width (64) or LSTM hidden (128)")
  p.add_argument("--layers", type=int, default=2, help="ViT blocks")
  p.add_argument("--heads", type=int, default=4, help="ViT heads")
  p.add_argument("--data-dir", default=None, help="MNIST-format idx files (see examples/data.py)")
  args = p.parse_args(argv)
  if args.width is None:
    args.width = 64 if args.model == "vit" else 128
  if args.quick:
    args.steps, args.warmup, args.compile_repeats = min(args.steps, 6), min(args.warmup, 1), 1
    args.batch_size, args.width, args.layers = min(args.batch_size, 32), 16, 1
  _harness.check_common_args(p, args)
  for flag in ("batch_size", "width", "layers", "heads"):
    if getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
  if args.model == "vit" and args.width % args.heads:
    p.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
  if args.with_upstream:
    p.error("--with-upstream: these workloads have no upstream kfac-jax version")
  return args


def make_workload(args) -> _harness.Workload:
  ds = data_lib.load_dataset("fashion_mnist", args.data_dir)
  h, w = ds.image_shape
  if args.model == "vit" and (h % PATCH or w % PATCH):
    raise ValueError(f"the ViT cuts {PATCH}x{PATCH} patches; {ds.name} images are {h}x{w}")
  x = ds.train_images.reshape(-1, h, w)
  y = ds.train_labels.astype(np.int32)
  if args.quick:
    x, y = x[:768], y[:768]
  held_out = 256 if args.quick else 5000
  train = {"x": x[:-held_out], "y": y[:-held_out]}
  test = {"x": jnp.asarray(x[-held_out:]), "y": jnp.asarray(y[-held_out:])}
  if args.model == "vit":
    model = ViT(width=args.width, layers=args.layers, heads=args.heads)
    about = f"ViT, {args.layers} block(s) of width {args.width}, {args.heads} heads, 7x7 patches"
  else:
    model = RowLSTM(hidden=args.width)
    about = f"LSTM (OptimizedLSTMCell, hidden {args.width}) over the {h} rows"
  params0 = model.init(jax.random.key(args.seed), train["x"][:1])
  loss_fn = cnn_lib.make_loss_fn(model)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params0))
  idx = ae.batch_indices(train["y"].shape[0], args.batch_size, args.warmup + args.steps, args.seed)
  eval_loss = jax.jit(loss_fn)
  return _harness.Workload(
    name=args.model,
    description=f"{about} ({n_params:,} parameters) on {ds.name}, batch {idx.shape[1]}; "
    f"data: {ds.source}",
    loss_fn=loss_fn,
    params0=params0,
    batch_at=lambda t: {k: v[idx[t]] for k, v in train.items()},
    eval_fn=lambda params: float(eval_loss(params, test)),
    eval_description=f"softmax cross-entropy, mean over {held_out} held-out training images",
  )


class Family:
  """`parse_args`/`make_workload` for one model, as `race.py` and `step_sweep.py` want them."""

  def __init__(self, model: str):
    self.model = model

  def parse_args(self, argv=None):
    return parse_args(["--model", self.model, *(argv or [])])

  make_workload = staticmethod(make_workload)


VIT, RNN = Family("vit"), Family("rnn")


def main(argv=None) -> int:
  return _harness.main(parse_args, make_workload, __file__, argv)


if __name__ == "__main__":
  sys.exit(main())

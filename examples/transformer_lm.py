"""A small character-level Transformer language model with tied embeddings: K-FAC against Adam.

Text available offline on any Debian-like machine: the license texts of
/usr/share/common-licenses (base-files), or, where that is missing, the Python standard
library's own source files. Two pre-LayerNorm blocks of causal self-attention and an MLP; the
output projection is the transposed input embedding (tied weights: one parameter used twice).
The scanner registers embedding, attention projections, MLP layers, LayerNorms and the tied
table without manual tags; the summary is printed first. Both optimizers start from the same
initialisation and see the same batches; prints the held-out loss (nats per character) and
writes a PNG of the training loss against steps and against seconds.

    python examples/transformer_lm.py           # ~2 minutes on 2 CPU cores
    python examples/transformer_lm.py --fast    # a few steps of a tiny model (used by the tests)
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import sysconfig

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


def load_text(max_chars: int) -> tuple[str, str]:
  """(text, source): license texts if present, else the standard library's sources."""
  files = sorted(glob.glob("/usr/share/common-licenses/*"))
  source = "/usr/share/common-licenses"
  if not files:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    source = "the Python standard library's sources"
  parts, total = [], 0
  for f in files:
    if os.path.isfile(f):
      with open(f, encoding="utf-8", errors="ignore") as fh:
        parts.append(fh.read())
      total += len(parts[-1])
    if total >= max_chars:
      break
  return "".join(parts)[:max_chars], source


class Block(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, x, mask):
    d = x.shape[-1]
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
    h = nn.Dense(4 * d)(nn.LayerNorm()(x))
    return x + nn.Dense(d)(nn.gelu(h))


class LM(nn.Module):
  vocab: int
  d: int = 64
  layers: int = 2
  heads: int = 4
  length: int = 64

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(self.vocab, self.d)
    pos = self.param("pos", nn.initializers.normal(0.02), (self.length, self.d))
    # Found automatically as a "shift" with a full (length·d)² block; a diagonal one is plenty
    # for a positional table. Manual tags take precedence over the scanner.
    pos = kfac_jax.register_generic(pos, approx="diagonal")
    x = embed(ids) + pos[: ids.shape[1]]
    mask = nn.make_causal_mask(ids)
    for _ in range(self.layers):
      x = Block(self.heads)(x, mask)
    return embed.attend(nn.LayerNorm()(x))  # Tied output projection.


def make_loss_fn(model):
  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).sum(-1).mean()

  return loss_fn


def windows(ids: np.ndarray, starts: np.ndarray, length: int) -> dict[str, np.ndarray]:
  idx = starts[:, None] + np.arange(length + 1)[None]
  w = ids[idx]
  return {"x": w[:, :-1], "y": w[:, 1:]}


def char_data(fast: bool, length: int, steps: int, batch_size: int, seed: int):
  """Character ids of the offline text, per-step window starts (first 90%) and a held-out batch.

  Returns `(ids, chars, starts [steps, batch_size], held {"x", "y"}, description)`.
  """
  text, source = load_text(40_000 if fast else 400_000)
  chars = sorted(set(text))
  lookup = {c: i for i, c in enumerate(chars)}
  ids = np.fromiter((lookup[c] for c in text), np.int32, len(text))
  split = int(0.9 * len(ids))
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, split - length - 1, size=(steps, batch_size))
  held = windows(ids[split:], rng.integers(0, len(ids) - split - length - 1, size=256), length)
  return (
    ids,
    chars,
    starts,
    held,
    (f"data: {len(text):,} characters of {source}, vocabulary {len(chars)}"),
  )


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--steps", type=int, default=None, help="default 150 (6 with --fast)")
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--length", type=int, default=64)
  p.add_argument("--kfac-lr", type=float, default=1.0)
  p.add_argument("--damping", type=float, default=0.1)
  p.add_argument("--adam-lr", type=float, default=3e-3)
  p.add_argument("--out", default="transformer_lm.png")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--fast", action="store_true")
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  steps = args.steps or (6 if args.fast else 150)
  length = 16 if args.fast else args.length
  ids, chars, starts, held, about = char_data(args.fast, length, steps, args.batch_size, args.seed)
  model = LM(
    vocab=len(chars), d=32 if args.fast else 64, layers=1 if args.fast else 2, length=length
  )
  params = model.init(jax.random.key(args.seed), jnp.zeros((1, length), jnp.int32))
  loss_fn = make_loss_fn(model)
  example = jax.tree_util.tree_map(jnp.asarray, windows(ids, starts[0], length))
  print(about)
  print(kfac_jax.summary(loss_fn, params, example))
  tx = kfac_jax.kfac(
    loss_fn,
    example,
    learning_rate=args.kfac_lr,
    damping=args.damping,
    inverse_every=10,
  )
  results = []
  print("| optimizer | held-out loss (nats/char) | median step (ms) | compile (s) |")
  print("|---|---:|---:|---:|")
  for name, t in (("K-FAC", tx), ("Adam", optax.adam(args.adam_lr))):
    r, final = common.train(
      name,
      t,
      loss_fn,
      params,
      lambda i: windows(ids, starts[i], length),
      steps,
      args.seed,
      not args.no_progress,
      loss_scale=1 / length,
    )
    r.final_loss = float(jax.jit(loss_fn)(final, jax.tree_util.tree_map(jnp.asarray, held)))
    r.final_loss /= length
    results.append(r)
    print(
      f"| {name} | {r.final_loss:.4f} | {1e3 * r.median_step_time:.1f} | {r.compile_time:.2f} |"
    )
  ae.plot(results, args.out, f"char-level Transformer LM, batch {args.batch_size}x{length}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

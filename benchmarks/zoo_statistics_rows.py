"""Which rows `kfac`'s `statistics_fraction="auto"` takes on every zoo model, at 256 rows.

The zoo's batches have 4 examples (`tests/_zoo.N`), below the 128 rows from which "auto" cuts
the batch. Here every batch leaf with that leading axis is tiled to 256 rows (outside
`batch["state"]`, the model state some models carry in the batch), each copy shifted by a
small per-row offset so that the rows differ, and `kfac_jax.kfac(loss_fn, batch,
learning_rate=0.3)` makes two `batch=` updates three ways: on its default ("auto"), with
`statistics_fraction=0.25` and with None (every row). A row reports which of the two the
default's updates equal ("cut": every fourth row; "whole": it fell back to every row),
whether they are finite, and whether the explicit 0.25 raised (it must, where "auto" falls
back on the leaves' leading axes). Timing-free. Exit status 1 if any default update is not
finite or equals neither.

    python benchmarks/zoo_statistics_rows.py
    python benchmarks/zoo_statistics_rows.py --models resnet,mlp
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

import kfac_jax  # noqa: E402
from benchmarks import zoo_defaults  # noqa: E402
from tests import _zoo  # noqa: E402

ROWS = 256


def tiled(batch):
  """Every leaf with the zoo's leading axis (outside `batch["state"]`) tiled to ROWS rows;
  floating leaves shifted by 0.01·row/ROWS so that no two rows are equal."""

  def tile(path, x):
    if any(getattr(k, "key", None) == "state" for k in path):
      return x
    if jnp.ndim(x) == 0 or jnp.shape(x)[0] != _zoo.N:
      return x
    x = jnp.concatenate([x] * (ROWS // _zoo.N), axis=0)
    if jnp.issubdtype(x.dtype, jnp.floating):
      x = x + (0.01 * jnp.arange(ROWS, dtype=x.dtype) / ROWS).reshape((-1,) + (1,) * (x.ndim - 1))
    return x

  return jax.tree_util.tree_map_with_path(tile, batch)


def updates(z: _zoo.Zoo, batch, **kwargs):
  """The updates after two `batch=` updates of `kfac` (the first refreshes the inverses)."""
  tx = kfac_jax.kfac(
    registration=kfac_jax.Registration(z.loss_fn, z.params, batch, has_aux=z.has_aux),
    learning_rate=0.3,
    config=kfac_jax.Config(**kwargs),
  )

  def loss(p):
    out = z.loss_fn(p, batch)
    return out[0] if z.has_aux else out

  grads = jax.grad(loss)(z.params)
  update = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b, rng=jax.random.key(1)))
  state = tx.init(z.params)
  for _ in range(2):
    u, state = update(grads, state, z.params, batch)
  return jax.tree_util.tree_leaves(u)


def _close(a, b) -> bool:
  return all(np.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(a, b, strict=True))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--models", default=None, help="comma-separated zoo names or name:flavour (default: all)"
  )
  args = p.parse_args(argv)
  names = zoo_defaults.model_names(p, args.models)
  print(f'`kfac` statistics_fraction="auto" on the zoo, batches tiled to {ROWS} rows\n')
  print("| model | default takes | finite | `statistics_fraction=0.25` |")
  print("|---|---|---|---|")
  bad, counts = [], {"cut": 0, "whole": 0, "neither": 0}
  for label, make in zoo_defaults._models(names):
    z = make()
    batch = tiled(z.batch)
    auto = updates(z, batch)
    whole = updates(z, batch, statistics_fraction=None)
    try:
      quarter, raised = updates(z, batch, statistics_fraction=0.25), ""
    except (TypeError, ValueError) as e:
      quarter, raised = None, type(e).__name__
    if quarter is not None and _close(auto, quarter) and not _close(auto, whole):
      took = "cut"
    elif _close(auto, whole):
      took = "whole"
    else:
      took = "neither"
    finite = all(bool(np.all(np.isfinite(x))) for x in auto)
    counts[took] += 1
    if took == "neither" or not finite:
      bad.append(label)
    explicit = f"raised {raised}" if raised else "ran"
    print(f"| {label} | {took} | {finite} | {explicit} |", flush=True)
  print(
    f"\njax {jax.__version__}; {counts['cut']} cut, {counts['whole']} whole, "
    f"{counts['neither']} neither; bad: {', '.join(bad) if bad else 'none'}"
  )
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())

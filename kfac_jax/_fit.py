"""Does a state fit the model and front it is handed to? One comparison by leaf path, shape and
dtype, shared by `check_restored_state` (a checkpoint) and every front's update (a state of
another model, layer configuration, storage or momentum setting is named before anything runs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from kfac_jax import _checks
from kfac_jax._specs import key_name


class _Leaf(NamedTuple):
  shape: tuple[int, ...]
  dtype: str
  block: str | None  # The block it belongs to, if any.
  field: str  # Its place inside the block's state, e.g. `factors/a` (the path if no block).


def _aval_key(x) -> tuple:
  """A leaf's shape, dtype, weak type and sharding (a concrete array's, else its type's)."""
  aval = jax.typeof(x)
  sharding = x.sharding if isinstance(x, jax.Array) and not _checks.is_traced(x) else None
  return (aval.shape, aval.dtype, aval.weak_type, sharding or getattr(aval, "sharding", None))


class Memo:
  """A bounded memo, the library's one cache: `memo(key, make)` is the value kept for `key`,
  made by `make()` on first use; past `size` keys the oldest is dropped."""

  def __init__(self, size: int):
    self._size = size
    self._kept: dict[Any, Any] = {}

  def __call__(self, key, make):
    if key not in self._kept:
      self.put(key, make())
    return self._kept[key]

  def get(self, key, default=None):
    return self._kept.get(key, default)

  def put(self, key, value) -> None:
    if key not in self._kept and len(self._kept) >= self._size:
      self._kept.pop(next(iter(self._kept)))
    self._kept[key] = value


def signature(params) -> tuple:
  """A hashable key of `params`' treedef, shapes, dtypes, weak types and shardings."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  return treedef, tuple(_aval_key(x) for x in leaves)


def state_shapes(init, size: int = 8) -> Callable:
  """`params -> jax.eval_shape(init, params)`, traced once per params `signature`: a front's
  update checks its state against it on every trace (every call of an eager step)."""
  memo = Memo(size)
  return lambda params: memo(signature(params), lambda: jax.eval_shape(init, params))


def describe(path) -> tuple[str, str | None, str]:
  """`(path string, block name or None, field)` for a leaf path of an optimizer state; the
  `value` attribute of a wrapper around each leaf (what `nnx.Optimizer` holds) is dropped."""
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
    path = path[:-1]
  names = [key_name(k) for k in path]
  block, field = None, "/".join(names)
  for i, n in enumerate(names[:-1]):
    if n in ("factors", "cache"):  # Estimator-state fields keyed by block name.
      block, field = names[i + 1], "/".join([n] + names[i + 2 :])
  if block == "buffers":
    block = None  # A ShardedCache (inverse_storage="sharded"): no per-block leaves to name.
  return "/".join(names), block, field


def _leaves(tree) -> dict[str, _Leaf]:
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name, block, field = describe(path)
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    out[name] = _Leaf(tuple(np.shape(leaf)), str(dtype), block, field)
  return out


def problems(expected: Any, got: Any, source: str) -> list[str]:
  """What differs between `got` (from `source`, e.g. "the checkpoint") and `expected`: missing
  and unexpected blocks, fields and leaves, and leaves of another shape or dtype."""
  want, have = _leaves(expected), _leaves(got)
  want_blocks = {leaf.block for leaf in want.values() if leaf.block}
  got_blocks = {leaf.block for leaf in have.values() if leaf.block}
  found = []
  missing, extra = sorted(want_blocks - got_blocks), sorted(got_blocks - want_blocks)
  if missing:
    found.append(f"blocks missing from {source}: {missing}")
  if extra:
    found.append(f"blocks in {source} that this model does not have: {extra}")
  # A leaf on one side only, unless its whole block is (named above).
  for one, other, blocks, says in (
    (want, have, got_blocks, f"is missing from {source}"),
    (have, want, want_blocks, f"in {source} is not part of this optimizer's state"),
  ):
    for p in sorted(set(one) - set(other)):
      leaf = one[p]
      if not leaf.block or leaf.block in blocks:
        where = f"block `{leaf.block}`: `{leaf.field}`" if leaf.block else f"`{p}`"
        found.append(f"{where} {says}")
  for p in sorted(set(want) & set(have)):
    w, g = want[p], have[p]
    if (w.shape, w.dtype) != (g.shape, g.dtype):
      where = f"block `{w.block}` `{w.field}` (`{p}`)" if w.block else f"`{p}`"
      found.append(
        f"{where}: {source} has {g.shape} {g.dtype}, this model needs {w.shape} {w.dtype}"
      )
  return found


def _hints(expected: Any, got: Any) -> list[str]:
  """The likely cause, where the paths show it: another storage or another momentum."""
  want, have = set(_leaves(expected)), set(_leaves(got))
  out = []
  sharded_w, sharded_g = (any("/buffers" in p for p in s) for s in (want, have))
  if sharded_g and not sharded_w:
    out.append("it is sharded (inverse_storage='sharded'); this front keeps a replicated state")
  if sharded_w and not sharded_g:
    out.append("it is replicated; this front keeps a sharded state (inverse_storage='sharded')")
  trace_w, trace_g = (any("/trace" in p for p in s) for s in (want, have))
  if trace_w != trace_g:
    out.append(
      "it was built without momentum (`momentum=None`), this front has momentum"
      if trace_w
      else "it was built with momentum, this front has none (`momentum=None`)"
    )
  return out


def check(expected: Any, got: Any, who: str, what: str = "state") -> None:
  """ValueError naming what differs (block, field, shape, dtype, storage, momentum) when `got`
  does not fit `expected` (this front's init, as shapes)."""
  found = problems(expected, got, f"`{what}`")
  if not found:
    return
  hints = _hints(expected, got)
  shown = found[:8] + ([f"... and {len(found) - 8} more"] if len(found) > 8 else [])
  raise ValueError(
    f"{who}: `{what}` is not a state of this model and front"
    + (f" ({'; '.join(hints)})" if hints else "")
    + ":\n  "
    + "\n  ".join(shown)
    + "\nPass the state this front's init returned for these params."
  )

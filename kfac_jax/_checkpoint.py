"""Saving and restoring optimizer state.

The whole K-FAC state (factors, inverses, counters, and whatever the rest of an `optax.chain`
keeps) is a pytree of arrays, so any pytree checkpointer stores it: orbax-checkpoint
(`ocp.StandardCheckpointer().save(path, opt_state)` / `.restore(path, target)`) or
flax.serialization (`state_to_bytes` / `state_from_bytes` below). Restoring continues a run
bit-for-bit: nothing lives outside the state.

What a checkpointer does not check is that the restored state belongs to the model: restored
into a model whose layers changed, a state may have the same structure but other factor shapes,
or miss blocks. `check_restored_state` compares a restored state with a freshly initialised one
and names every block that differs.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

_BLOCK_FIELDS = ("factors", "cache")


def _describe(path) -> tuple[str, str | None]:
  """`(path string, block name or None)` for a leaf path of an optimizer state."""
  names = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      names.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      names.append(k.name)
    elif isinstance(k, jax.tree_util.SequenceKey):
      names.append(str(k.idx))
    else:
      names.append(str(k))
  block = None
  for i, n in enumerate(names[:-1]):
    if n in _BLOCK_FIELDS:
      block = names[i + 1]
  if block == "buffers" and "cache" in names:
    block = None  # A ShardedCache (inverse_storage="sharded"): no per-block leaves to name.
  return "/".join(names), block


def _leaves(tree) -> dict[str, tuple[tuple[int, ...], str, str | None]]:
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name, block = _describe(path)
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    out[name] = (tuple(np.shape(leaf)), str(dtype), block)
  return out


def check_restored_state(expected: Any, restored: Any) -> None:
  """Raises if `restored` does not fit the model `expected` (e.g. `tx.init(params)`) was built for.

  Args:
    expected: a freshly initialised state (or its `jax.eval_shape`) for the current model.
    restored: the state read from a checkpoint.

  Raises:
    ValueError: listing the blocks that are missing, unexpected, or have other factor or
      inverse shapes or dtypes, and every other mismatching leaf by its path.
  """
  want, got = _leaves(expected), _leaves(restored)
  problems = []
  missing = sorted({b for p, (_, _, b) in want.items() if p not in got and b})
  extra = sorted({b for p, (_, _, b) in got.items() if p not in want and b})
  if missing:
    problems.append(f"blocks missing from the checkpoint: {missing}")
  if extra:
    problems.append(f"blocks in the checkpoint that this model does not have: {extra}")
  for p in sorted(set(want) - set(got)):
    if not want[p][2]:
      problems.append(f"`{p}` is missing from the checkpoint")
  for p in sorted(set(got) - set(want)):
    if not got[p][2]:
      problems.append(f"`{p}` in the checkpoint is not part of this optimizer's state")
  for p in sorted(set(want) & set(got)):
    (ws, wd, block), (gs, gd, _) = want[p], got[p]
    if ws != gs or wd != gd:
      where = f"block `{block}` (`{p}`)" if block else f"`{p}`"
      problems.append(f"{where}: checkpoint has {gs} {gd}, this model needs {ws} {wd}")
  if problems:
    raise ValueError(
      "the restored optimizer state does not fit this model (did its layers change?):\n  "
      + "\n  ".join(problems)
      + "\nRestore into a state initialised for the same model, or start the optimizer afresh."
    )


def state_to_bytes(state: Any) -> bytes:
  """Serialises an optimizer state with flax.serialization (msgpack)."""
  from flax import serialization  # flax is an optional dependency.

  return serialization.to_bytes(state)


def state_from_bytes(expected: Any, data: bytes) -> Any:
  """Restores `state_to_bytes` output into the structure of `expected`, checking it first.

  Raises:
    ValueError: the saved state does not fit `expected` (see `check_restored_state`).
  """
  from flax import serialization  # flax is an optional dependency.

  raw = serialization.msgpack_restore(data)
  template = serialization.to_state_dict(expected)
  check_restored_state(template, raw)
  return serialization.from_state_dict(expected, raw)

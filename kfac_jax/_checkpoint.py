"""Saving and restoring optimizer state (docs/checkpoints.rst)."""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np

from kfac_jax import _fit


def _plain(state: Any) -> Any:
  """`state` in plain containers, as flax.serialization writes them (nnx objects unwrapped)."""
  nnx = sys.modules.get("flax.nnx")  # Without it imported, there is no nnx object.
  if nnx is None:
    return state
  if _nnx_object(state):
    state = nnx.state(state)

  held = lambda x: isinstance(x, (nnx.State, nnx.Variable))

  def one(x):
    if isinstance(x, nnx.State):
      return x.to_pure_dict()
    return x.get_value() if isinstance(x, nnx.Variable) else x

  if not any(held(x) for x in jax.tree_util.tree_leaves(state, is_leaf=held)):
    return state
  return jax.tree_util.tree_map(one, state, is_leaf=held)


def _nnx_object(state: Any) -> bool:
  """Whether `state` is an nnx object (a module, an `nnx.Optimizer`), not a pytree of arrays."""
  nnx = sys.modules.get("flax.nnx")
  base = getattr(nnx, "Pytree", getattr(nnx, "Object", None))
  return base is not None and isinstance(state, base)


def check_restored_state(expected: Any, restored: Any) -> None:
  """Raises if `restored` does not fit the model `expected` (e.g. `tx.init(params)`) was built for.

  Args:
    expected: a freshly initialised state (or its `jax.eval_shape`) for the current model.
    restored: the state read from a checkpoint.

  Raises:
    ValueError: listing every missing, unexpected or mismatching block, field or leaf by path.
  """
  problems = _fit.problems(expected, restored, "the checkpoint")
  if problems:
    raise ValueError(
      "the restored optimizer state does not fit this model (did its layers or options change?):"
      + "".join(f"\n  {p}" for p in problems)
      + "\nRestore into a state initialised for the same model, or start the optimizer afresh."
    )


def state_to_bytes(state: Any) -> bytes:
  """Serialises an optimizer state (or an `nnx.Optimizer`, its `nnx.state`) with flax's msgpack.

  Raises:
    ValueError: naming the first array that spans other processes' devices.
  """
  from flax import serialization  # flax is an optional dependency.

  state = _plain(state)

  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    split = isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
    if split and not leaf.is_fully_replicated:
      raise ValueError(
        f"state_to_bytes: `{_fit.describe(path)[0]}` is split over devices of other processes "
        f"({leaf.sharding}), so no one process can write it whole: save the state with "
        "orbax-checkpoint (`ocp.StandardCheckpointer().save(path, opt_state)`), which writes "
        "each process's shards, and restore it into a target with the same shardings."
      )
  return serialization.to_bytes(state)


def state_from_bytes(expected: Any, data: bytes) -> Any:
  """Restores `state_to_bytes` output into the structure of `expected`, checking it first.

  Raises:
    ValueError: the saved state does not fit `expected` (see `check_restored_state`).
    TypeError: `expected` is an nnx object (pass its `nnx.state`).
  """
  from flax import serialization  # flax is an optional dependency.

  if _nnx_object(expected):
    raise TypeError(
      f"state_from_bytes: `expected` is an nnx object ({type(expected).__name__}), which a "
      "restore would change in place: pass its state, `restored = kfac_jax.state_from_bytes("
      "nnx.state(optimizer), data)`, then `nnx.update(optimizer, restored)`."
    )
  plain = _plain(expected)
  raw = serialization.msgpack_restore(data)
  template = serialization.to_state_dict(plain)
  check_restored_state(template, raw)
  restored = serialization.from_state_dict(plain, raw)
  if plain is expected:
    return restored
  # Back into `expected`'s nnx containers, leaves matched by identity (pure dicts reorder).
  position = {id(x): i for i, x in enumerate(jax.tree_util.tree_leaves(plain))}
  leaves, treedef = jax.tree_util.tree_flatten(expected)
  new = jax.tree_util.tree_leaves(restored)
  if len(position) != len(leaves) or any(id(x) not in position for x in leaves):
    raise ValueError(
      "state_from_bytes: `expected` holds one array object at several places: pass a freshly "
      "initialised state, e.g. `nnx.state(optimizer)` of a new `nnx.Optimizer`."
    )
  return jax.tree_util.tree_unflatten(treedef, [new[position[id(x)]] for x in leaves])


def restore_state(expected: Any, saved: Any) -> Any:
  """Rebuilds a state saved through a generic container into the structure of `expected`.

  Any container of the state's leaves in order is accepted (docs/checkpoints.rst).

  Args:
    expected: a freshly initialised state (e.g. `opt.init(params)`, or its `jax.eval_shape`).
    saved: the value read back.

  Returns:
    The state, of `expected`'s type and structure.

  Raises:
    ValueError: the number of leaves differs, or a leaf does not fit.

  Example:
    >>> import io
    >>> import numpy as np
    >>> f = io.BytesIO()
    >>> np.savez(f, opt_state=np.asarray(opt_state, dtype=object))
    >>> _ = f.seek(0)
    >>> saved = np.load(f, allow_pickle=True)["opt_state"]
    >>> opt_state = kfac_jax.restore_state(tx.init(params), saved)
  """

  def lists(x):
    if isinstance(x, np.ndarray) and x.dtype == object:
      return [lists(v) for v in x.tolist()] if x.ndim else lists(x.item())
    return x

  got = jax.tree_util.tree_leaves(lists(saved))
  want, treedef = jax.tree_util.tree_flatten(expected)
  if len(got) != len(want):
    raise ValueError(
      f"restore_state: the saved value holds {len(got)} arrays, the state {len(want)}: restore "
      "into a state initialised for the optimizer and model it was saved from."
    )
  rebuilt = jax.tree_util.tree_unflatten(treedef, [jax.numpy.asarray(x) for x in got])
  check_restored_state(expected, rebuilt)
  return rebuilt

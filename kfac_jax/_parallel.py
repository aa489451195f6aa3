"""Data parallelism: splitting the inverse work across the devices of a mapped axis.

Statistics are averaged over the data-parallel axis (`lax.pmean` on `axis_name`, or by XLA under
`jit` with sharded inputs). The inverse update is the expensive, batch-independent part: instead
of every device factorising every block, each device factorises its share and the results are
summed over the axis (`lax.psum`), every other device contributing zeros. A sum with zeros is
exact, so the split path gives bit-for-bit the numbers of the replicated one.

Shares are balanced by estimated cost (Σ n³ over a block's matrix factors) with the
longest-processing-time rule: blocks in decreasing cost, each to the least-loaded device. Equal
blocks therefore spread round-robin (counts differ by at most one) and the most- and
least-loaded devices differ by at most one block's cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def factorisation_cost(factor_shapes: Sequence[tuple[int, ...]]) -> float:
  """Relative cost of refreshing a block's cache: n³ per [n, n] factor, n per vector."""
  cost = 0.0
  for s in factor_shapes:
    if len(s) == 2 and s[0] == s[1]:
      cost += float(s[0]) ** 3
    else:
      cost += float(math.prod(s))
  return cost


def assign(costs: Sequence[float], num_devices: int) -> tuple[tuple[int, ...], ...]:
  """Block indices per device, balanced by cost (longest processing time first).

  Ties (equal cost, equal load) go to the lower index, so the assignment is deterministic and
  identical on every host.
  """
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
  loads = [0.0] * num_devices
  shares: list[list[int]] = [[] for _ in range(num_devices)]
  for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
    d = min(range(num_devices), key=lambda d: (loads[d], len(shares[d]), d))
    shares[d].append(i)
    loads[d] += costs[i]
  return tuple(tuple(sorted(s)) for s in shares)


def split_over_axis(compute: Callable[[Sequence[int]], dict[str, Any]], zeros: dict[str, Any],
                    costs: Sequence[float], axis_name: str) -> dict[str, Any]:
  """Runs `compute` on each device's share of the blocks and sums the results over `axis_name`.

  Args:
    compute: `compute(block_indices) -> {name: cache}` for the given blocks.
    zeros: `{name: cache of zeros}` for every block (the structure of the result).
    costs: estimated cost per block, by block index.
    axis_name: a bound pmap / shard_map axis.

  Returns:
    `{name: cache}` for every block, identical on every device of the axis.
  """
  shares = assign(costs, jax.lax.axis_size(axis_name))
  busy = [s for s in shares if s]

  def branch(share):
    def run():
      out = dict(zeros)
      out.update(compute(share))
      return out
    return run

  # One branch per non-empty share, plus an idle one for devices without blocks (more devices
  # than blocks); a static table maps each device to its branch.
  branches = [branch(s) for s in busy] + [lambda: dict(zeros)]
  table = jnp.asarray([busy.index(s) if s else len(busy) for s in shares], jnp.int32)
  local = jax.lax.switch(table[jax.lax.axis_index(axis_name)], branches)
  return jax.lax.psum(local, axis_name)


def over_mesh_axis(split: Callable[..., Any], mesh: tuple[Any, str], factors, damping):
  """`split(factors, damping, axis)` inside a `shard_map` over one axis of `mesh`.

  For plain `jit` with sharded data: the factors are replicated (XLA has already reduced the
  statistics), each device of the mesh axis factorises its share, and the psum inside `split`
  returns replicated caches.
  """
  try:
    m, axis = mesh
  except (TypeError, ValueError):
    raise TypeError(f"`mesh` must be a (jax.sharding.Mesh, axis_name) pair, got {mesh!r}.") from None
  if axis not in m.axis_names:
    raise ValueError(f"mesh axis {axis!r} is not in the mesh, whose axes are {m.axis_names}.")
  spec = jax.sharding.PartitionSpec()
  fn = jax.shard_map(lambda f, d: split(f, d, axis), mesh=m, in_specs=(spec, spec),
                     out_specs=spec, axis_names=frozenset({axis}), check_vma=False)
  return fn(factors, damping)

"""Data parallelism: splitting the inverse work across the devices of a mapped axis.

Statistics are averaged over the data-parallel axis (`lax.pmean`, or by XLA under `jit`). The
refresh is the expensive, batch-independent part: each device factorises its share of the
blocks and the results are summed over the axis (`lax.psum`), every other device contributing
zeros, so the split path gives bit-for-bit the replicated numbers. Shares are balanced by cost
(Σ n³ over a block's matrix factors) with the longest-processing-time rule; blocks of identical
shapes are placed one after another, so they spread round-robin and each device factorises its
blocks of one shape as one stack.

`inverse_storage="sharded"` (`kfac_jax._storage`) keeps each device's share of the state in
flat per-dtype buffers at static offsets (`packed_layout`, `pack`, `unpack`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def factorisation_cost(factor_shapes: Sequence[tuple[int, ...]]) -> float:
  """Relative cost of refreshing a block's cache: n³ per [..., n, n] factor, n per vector."""
  cost = 0.0
  for s in factor_shapes:
    if len(s) >= 2 and s[-1] == s[-2]:
      cost += float(math.prod(s[:-2])) * float(s[-1]) ** 3
    else:
      cost += float(math.prod(s))
  return cost


def assign(
  costs: Sequence[float],
  num_devices: int,
  *,
  sizes: Sequence[float] | None = None,
  keys: Sequence[Any] | None = None,
  slack: float = 1.25,
) -> tuple[tuple[int, ...], ...]:
  """Block indices per device, balanced by cost (longest processing time first).

  Blocks go in decreasing cost (equal `keys` one after another), each to the device with the
  least cost so far, ties to the lower index (the same on every host). With `sizes` (bytes), a
  device is eligible only while it stays within `slack · Σ sizes / D + max(sizes)`; the device
  with the fewest bytes always is, so every block is placed.
  """
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
  n = len(costs)
  rank: dict[Any, int] = {}
  key_rank = [rank.setdefault(k, len(rank)) for k in keys] if keys is not None else [0] * n
  size = [float(x) for x in sizes] if sizes is not None else [0.0] * n
  cap = slack * sum(size) / num_devices + max(size, default=0.0)
  loads = [0.0] * num_devices
  held = [0.0] * num_devices
  shares: list[list[int]] = [[] for _ in range(num_devices)]
  for i in sorted(range(n), key=lambda i: (-costs[i], key_rank[i], i)):
    fits = [d for d in range(num_devices) if held[d] + size[i] <= cap]
    d = min(fits or range(num_devices), key=lambda d: (loads[d], len(shares[d]), held[d], d))
    shares[d].append(i)
    loads[d] += costs[i]
    held[d] += size[i]
  return tuple(tuple(sorted(s)) for s in shares)


def refresh_assignment(
  factor_shapes: Sequence[Sequence[tuple[int, ...]]],
  num_devices: int,
  sizes: Sequence[float] | None = None,
) -> tuple[tuple[int, ...], ...]:
  """`assign` of blocks with these factor shapes by `factorisation_cost`, identical shapes as
  one key, each device's bytes capped by `sizes` if given."""
  shapes = [tuple(tuple(int(n) for n in s) for s in f) for f in factor_shapes]
  costs = [factorisation_cost(f) for f in shapes]
  return assign(costs, num_devices, sizes=sizes, keys=shapes)


def check_auto_axis(mesh, axis: str) -> None:
  """Raises unless `axis` of `mesh` is automatic (the split inverse work is a `shard_map` whose
  branches differ per device, which an explicit axis does not type)."""
  if mesh.axis_types[mesh.axis_names.index(axis)] == jax.sharding.AxisType.Explicit:
    raise ValueError(
      f"`config.mesh`: axis {axis!r} of the mesh is AxisType.Explicit; the inverses are split "
      "over an automatic axis only. Build the mesh with AxisType.Auto for that axis, or drop "
      "`config.mesh` (and inverse_storage='sharded'): every device then computes every "
      "inverse, which explicit meshes support."
    )


# -- sharded storage: each device keeps only its own blocks' state -------------------------------
#
# SPMD programs need one shape on every device, while the shares differ: each device stores its
# blocks' arrays raveled, at static offsets, in one flat buffer per dtype, zero-padded to the
# longest share's length L; the device's index selects (lax.switch) the branch with its offsets.


class ShardedCache(NamedTuple):
  """Per-block state under `inverse_storage="sharded"` (the factors, or the caches): each
  device holds only its share.

  Attributes:
    buffers: per dtype name (e.g. "float32"), the device's blocks' arrays in one flat buffer:
      `[L]` inside pmap / shard_map, `[D, L]` as a pmap output, `[D·L]` sharded over the mesh
      axis under jit (L: the largest share's size).
  """

  buffers: dict[str, Array]


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where leaf `leaf` of block `block`'s state sits in its device's buffer."""

  block: int
  leaf: int
  dtype: str
  offset: int
  shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """Static placement of every block's state (factors or cache) on `len(shares)` devices.

  Attributes:
    shares: block indices per device.
    slots: per device, the `Slot`s of its blocks' arrays.
    lengths: per dtype name, the buffer length L (the longest share; at least 1).
    treedefs: per block, the structure of its state.
  """

  shares: tuple[tuple[int, ...], ...]
  slots: tuple[tuple[Slot, ...], ...]
  lengths: tuple[tuple[str, int], ...]
  treedefs: tuple[Any, ...]

  @property
  def num_devices(self) -> int:
    return len(self.shares)


def packed_layout(shapes: Sequence[Any], shares: tuple[tuple[int, ...], ...]) -> PackedLayout:
  """Places the blocks' arrays (`shapes`: per block, a pytree of `jax.ShapeDtypeStruct`, its
  leaves in pytree order) in per-dtype buffers, one per device, the blocks `shares[d]` on d."""
  flat = [jax.tree_util.tree_flatten(c) for c in shapes]
  slots: list[tuple[Slot, ...]] = []
  lengths: dict[str, int] = {}
  for share in shares:
    offsets: dict[str, int] = {}
    mine = []
    for i in share:
      for k, s in enumerate(flat[i][0]):
        dtype = np.dtype(s.dtype).name
        off = offsets.get(dtype, 0)
        mine.append(Slot(i, k, dtype, off, tuple(s.shape)))
        offsets[dtype] = off + math.prod(s.shape)
    slots.append(tuple(mine))
    for dtype, n in offsets.items():
      lengths[dtype] = max(lengths.get(dtype, 0), n)
  dtypes = sorted({np.dtype(s.dtype).name for leaves, _ in flat for s in leaves})
  return PackedLayout(
    shares,
    tuple(slots),
    tuple((d, max(lengths.get(d, 0), 1)) for d in dtypes),
    tuple(treedef for _, treedef in flat),
  )


def pack(layout: PackedLayout, device: int, caches: dict[int, Any]) -> dict[str, Array]:
  """Device `device`'s buffers from its blocks' states (`{block index: state}`), zero-padded."""
  parts: dict[str, list[Array]] = {d: [] for d, _ in layout.lengths}
  leaves = {i: jax.tree_util.tree_leaves(c) for i, c in caches.items()}
  for s in layout.slots[device]:
    parts[s.dtype].append(jnp.ravel(leaves[s.block][s.leaf]).astype(s.dtype))
  out = {}
  for dtype, length in layout.lengths:
    used = sum(p.size for p in parts[dtype])
    parts[dtype].append(jnp.zeros((length - used,), dtype))
    out[dtype] = jnp.concatenate(parts[dtype])
  return out


def unpack(layout: PackedLayout, device: int, buffers: dict[str, Array]) -> dict[int, Any]:
  """Inverse of `pack`: `{block index: state}` for device `device`'s blocks."""
  leaves: dict[int, list[Array]] = {i: [] for i in layout.shares[device]}
  for s in layout.slots[device]:  # In each block's leaf order.
    size = math.prod(s.shape)
    leaves[s.block].append(buffers[s.dtype][s.offset : s.offset + size].reshape(s.shape))
  return {i: jax.tree_util.tree_unflatten(layout.treedefs[i], v) for i, v in leaves.items()}


def on_own_share(fn: Callable[[int], Any], shares: Sequence[Sequence[int]], axis_name: str) -> Any:
  """`fn(device)` on each device of `axis_name` (`shares` has one entry per device), with
  `device` static inside `fn`; devices without blocks share one branch."""
  size = len(shares)
  busy = [d for d in range(size) if shares[d]]
  idle = [d for d in range(size) if not shares[d]]
  branches = [lambda d=d: fn(d) for d in busy + idle[:1]]
  table = jnp.asarray([busy.index(d) if d in busy else len(busy) for d in range(size)], jnp.int32)
  if len(branches) == 1:
    return branches[0]()
  return jax.lax.switch(table[jax.lax.axis_index(axis_name)], branches)


def mesh_axis(mesh) -> tuple[Any, str]:
  """Checks a `(jax.sharding.Mesh, axis_name)` pair."""
  try:
    m, axis = mesh
  except (TypeError, ValueError):
    raise TypeError(
      f"`mesh` must be a (jax.sharding.Mesh, axis_name) pair, got {mesh!r}."
    ) from None
  if axis not in m.axis_names:
    raise ValueError(f"mesh axis {axis!r} is not in the mesh, whose axes are {m.axis_names}.")
  check_auto_axis(m, axis)
  return m, axis


def over_mesh(
  fn: Callable[..., Any], mesh: tuple[Any, str], args: tuple, sharded: tuple[bool, ...], out_sharded
) -> Any:
  """`fn(axis, *args)` inside a `shard_map` over one axis of `mesh`; the arguments flagged in
  `sharded` (and outputs in the `out_sharded` prefix tree) split over it, the others replicated."""
  m, axis = mesh_axis(mesh)
  rep, split = jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(axis)
  in_specs = tuple(split if s else rep for s in sharded)
  out_specs = jax.tree_util.tree_map(lambda s: split if s else rep, out_sharded)
  return jax.shard_map(
    lambda *a: fn(axis, *a),
    mesh=m,
    in_specs=in_specs,
    out_specs=out_specs,
    axis_names=frozenset({axis}),
    check_vma=False,
  )(*args)


def explicit_axes_as_auto(fn: Callable[..., Any], *args: Any, like: Any = None) -> Any:
  """`fn(*args)`, also under a mesh with explicit axes: K-FAC's statistics and products
  contract over sharded axes, so `fn` runs with them made automatic (`jax.sharding.auto_axes`)
  and XLA places the reductions. The outputs are replicated, or sharded as the leaves of `like`.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not mesh.explicit_axes:
    return fn(*args)
  rep = jax.sharding.PartitionSpec()
  if like is None:
    out = rep
  else:
    out = jax.tree_util.tree_map(lambda x: jax.typeof(x).sharding.spec, like)
  return jax.sharding.auto_axes(fn, axes=mesh.explicit_axes, out_sharding=out)(*args)


def vdot(x: Array, y: Array) -> Array:
  """`jnp.vdot(x, y)`, also for operands sharded over explicit mesh axes (a replicated scalar)."""
  return explicit_axes_as_auto(jnp.vdot, x, y)


def replicate_on_mesh(tree, params, mesh) -> Any:
  """`tree` with each concrete array on one device replicated over a mesh: `mesh`'s
  (`(Mesh, axis)` or None), else that of a `params` leaf laid out by a `NamedSharding`; as is
  without one (and under a trace, where the step's program places the values itself).

  A state made eagerly for a sharded model then has the shardings the jitted step returns for
  it, so the second step runs the first step's program instead of compiling another."""
  m = mesh[0] if mesh is not None else None
  if m is None:
    for leaf in jax.tree_util.tree_leaves(params):
      sharding = getattr(leaf, "sharding", None)
      if isinstance(sharding, jax.sharding.NamedSharding) and not isinstance(leaf, jax.core.Tracer):
        m = sharding.mesh
        break
  if m is None:
    return tree
  replicated = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec())

  def place(x):
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      if isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
        return jax.device_put(x, replicated)
    return x

  return jax.tree_util.tree_map(place, tree)

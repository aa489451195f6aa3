"""Data parallelism: splitting the inverse work across the devices of a mapped axis.

Statistics are averaged over the data-parallel axis (`lax.pmean` on `axis_name`, or by XLA under
`jit` with sharded inputs). The inverse update is the expensive, batch-independent part: instead
of every device factorising every block, each device factorises its share and the results are
summed over the axis (`lax.psum`), every other device contributing zeros. A sum with zeros is
exact, so the split path gives bit-for-bit the numbers of the replicated one.

Shares are balanced by estimated cost (Σ n³ over a block's matrix factors, k·b³ for a side kept
as k diagonal blocks) with the longest-processing-time rule: blocks in decreasing cost, each to
the least-loaded device. Blocks of identical factor shapes are placed one after another, so
on level devices they spread round-robin (counts differ by at most one), and each device
factorises its share of a shape as one stack; the most- and least-loaded devices differ by at
most one block's cost.

The second half of the module lays the state out for `inverse_storage="sharded"` (each device
keeps only its own blocks' factors and caches; see `kfac_jax._storage`): the same cost-balanced
shares, capped in bytes, packed into flat per-device buffers at static offsets.
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
  """Relative cost of refreshing a block's cache: n³ per [n, n] factor (times any leading stack
  or group axes), n per vector."""
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

  Blocks go in decreasing cost, each to the device with the least cost so far. Blocks of equal
  cost and equal `keys` (identical factor shapes) are placed one after another, so on level
  devices they spread round-robin; each device factorises its blocks of one shape as one
  stack. With `sizes` (each block's bytes), a device is eligible only while its bytes stay
  within `slack · Σ sizes / D + max(sizes)`; the device with the fewest bytes always is (it
  holds at most the average of what is placed), so the cap never leaves a block unplaced.

  Ties (equal cost, equal load) go to the lower index, so the assignment is deterministic and
  identical on every host.
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
  """The refresh work of blocks with these factor shapes, assigned to `num_devices` devices.

  Each block costs `factorisation_cost` of its shapes (n³ per [n, n] factor, k·b³ for a
  blocked side `[k, b, b]`); blocks with identical shapes are one stack (`assign`'s `keys`), and
  `sizes`, if given, caps each device's bytes (see `assign`). A pure function of its arguments,
  so every host computes the same assignment.
  """
  shapes = [tuple(tuple(int(n) for n in s) for s in f) for f in factor_shapes]
  costs = [factorisation_cost(f) for f in shapes]
  return assign(costs, num_devices, sizes=sizes, keys=shapes)


def busiest_share(costs: Sequence[float], shares: Sequence[Sequence[int]]) -> float:
  """The busiest device's cost over the mean device's: 1 is perfect balance."""
  loads = [sum(costs[i] for i in s) for s in shares]
  mean = sum(loads) / len(loads)
  return max(loads) / mean if mean else 1.0


def split_over_axis(
  compute: Callable[[Sequence[int]], dict[str, Any]],
  zeros: dict[str, Any],
  factor_shapes: Sequence[Sequence[tuple[int, ...]]],
  axis_name: str,
) -> dict[str, Any]:
  """Runs `compute` on each device's share of the blocks and sums the results over `axis_name`.

  Args:
    compute: `compute(block_indices) -> {name: cache}` for the given blocks.
    zeros: `{name: cache of zeros}` for every block (the structure of the result).
    factor_shapes: per block, its factor shapes (`refresh_assignment`).
    axis_name: a bound pmap / shard_map axis.

  Returns:
    `{name: cache}` for every block, identical on every device of the axis.
  """
  shares = refresh_assignment(factor_shapes, jax.lax.axis_size(axis_name))
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
    raise TypeError(
      f"`mesh` must be a (jax.sharding.Mesh, axis_name) pair, got {mesh!r}."
    ) from None
  if axis not in m.axis_names:
    raise ValueError(f"mesh axis {axis!r} is not in the mesh, whose axes are {m.axis_names}.")
  check_auto_axis(m, axis)
  spec = jax.sharding.PartitionSpec()
  fn = jax.shard_map(
    lambda f, d: split(f, d, axis),
    mesh=m,
    in_specs=(spec, spec),
    out_specs=spec,
    axis_names=frozenset({axis}),
    check_vma=False,
  )
  return fn(factors, damping)


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


# -- sharded storage: each device keeps only its own blocks' caches ------------------------------
#
# SPMD programs need one shape on every device, while the shares differ. Each device therefore
# stores its blocks' cache arrays raveled and concatenated, at static offsets, in one flat buffer
# per dtype, zero-padded to the longest share's length L. The device's index selects (lax.switch)
# the branch that knows its offsets. Under `pmap` the global buffer is `[D, L]`; under `jit` with
# a mesh it is `[D·L]`, sharded over the mesh axis; inside the mapped function it is `[L]`.


class ShardedCache(NamedTuple):
  """Per-block state under `inverse_storage="sharded"` (the factors, or the caches): each
  device holds only its share.

  Attributes:
    buffers: per dtype name (e.g. "float32"), the device's blocks' arrays packed into one flat
      buffer: `[L]` inside pmap / shard_map, `[D, L]` as a pmap output, `[D·L]` sharded over
      the mesh axis under jit. L is the largest device share's size.
  """

  buffers: dict[str, Array]


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where one cache array (leaf `leaf` of the block's cache pytree) sits in its device's
  buffer."""

  block: int
  leaf: int
  dtype: str
  offset: int
  shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """Static placement of every block's cache on `len(shares)` devices.

  Attributes:
    shares: block indices per device (balanced by cache bytes with `assign`).
    slots: per device, the `Slot`s of its blocks' cache arrays.
    lengths: per dtype name, the buffer length L (the longest share; at least 1).
    treedefs: per block, the structure of its cache (its block kind's cache type).
  """

  shares: tuple[tuple[int, ...], ...]
  slots: tuple[tuple[Slot, ...], ...]
  lengths: tuple[tuple[str, int], ...]
  treedefs: tuple[Any, ...]

  @property
  def num_devices(self) -> int:
    return len(self.shares)

  def device_bytes(self) -> int:
    """Bytes of one device's buffers (every device stores the same, padded length)."""
    return sum(n * np.dtype(d).itemsize for d, n in self.lengths)


def packed_layout(
  cache_shapes: Sequence[Any],
  num_devices: int,
  shares: tuple[tuple[int, ...], ...] | None = None,
) -> PackedLayout:
  """Places the blocks' arrays in per-dtype buffers, one per device.

  Args:
    cache_shapes: per block, a pytree of `jax.ShapeDtypeStruct` (e.g.
      `jax.eval_shape(block.init_cache)`); its leaves are placed in pytree order.
    num_devices: D, the size of the mapped axis.
    shares: block indices per device; by default the blocks are balanced by bytes with
      `assign`, which bounds the largest share by `total/D + the largest block's bytes` (the
      share that receives its last block was the least loaded, at most the average, before it).
  """
  flat = [jax.tree_util.tree_flatten(c) for c in cache_shapes]
  nbytes = [
    float(sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in leaves))
    for leaves, _ in flat
  ]
  if shares is None:
    shares = assign(nbytes, num_devices)
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
  """Device `device`'s buffers from its blocks' caches (`{block index: cache}`), zero-padded."""
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
  """Inverse of `pack`: `{block index: cache}` (typed caches) for device `device`'s blocks."""
  leaves: dict[int, list[Array]] = {i: [] for i in layout.shares[device]}
  for s in layout.slots[device]:  # In each block's leaf order.
    size = math.prod(s.shape)
    leaves[s.block].append(buffers[s.dtype][s.offset : s.offset + size].reshape(s.shape))
  return {i: jax.tree_util.tree_unflatten(layout.treedefs[i], v) for i, v in leaves.items()}


def on_own_share(fn: Callable[[int], Any], layout: PackedLayout, axis_name: str) -> Any:
  """`fn(device)` on each device of `axis_name`, with `device` static inside `fn`.

  Devices without blocks share one branch, so the program holds each block's code once.
  """
  size = jax.lax.axis_size(axis_name)
  if size != layout.num_devices:
    raise ValueError(
      f"the sharded cache was laid out for {layout.num_devices} devices, but axis "
      f"{axis_name!r} has {size}. Initialise the state on the axis it is used with."
    )
  busy = [d for d in range(size) if layout.shares[d]]
  idle = [d for d in range(size) if not layout.shares[d]]
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
  """`fn(axis, *args)` inside a `shard_map` over one axis of `mesh`.

  Arguments flagged in `sharded` (and outputs in the `out_sharded` prefix tree) are split over
  the axis along their first dimension; the others are replicated.
  """
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
  """`fn(*args)`, also under a mesh with explicit axes (`AxisType.Explicit`).

  Under such a mesh JAX asks every contraction over a sharded dimension for the sharding of its
  result. K-FAC's statistics sum over the (sharded) batch and its products contract over the
  (possibly sharded) parameter axes, so `fn` runs with the explicit axes made automatic
  (`jax.sharding.auto_axes`): XLA places the reductions, as under an automatic mesh. The outputs
  are replicated, or sharded as the matching leaves of `like`.
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

"""Data parallelism: each device factorises its share of the blocks (balanced by cost) and the
results are summed over the axis, the others contributing zeros, so the split gives the
replicated numbers bit for bit. Sharded storage packs each share in per-dtype flat buffers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Shares = tuple[tuple[int, ...], ...]  # Block indices per device.


def factorisation_cost(factor_shapes: Sequence[tuple[int, ...]]) -> float:
  """Relative cost of refreshing a block's cache: n³ per [..., n, n] factor, n per vector."""
  cost = 0.0
  for s in factor_shapes:
    square = len(s) >= 2 and s[-1] == s[-2]
    cost += float(math.prod(s[:-2])) * float(s[-1]) ** 3 if square else float(math.prod(s))
  return cost


def assign(
  costs: Sequence[float], num_devices: int, *, sizes=None, keys=None, slack=1.25
) -> Shares:
  """Block indices per device, balanced by cost (longest processing time first, equal `keys`
  one after another); with `sizes` (bytes), a device takes a block only while it stays within
  `slack · Σ sizes / D + max(sizes)`, or when no device can."""
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
  n = len(costs)
  rank: dict[Any, int] = {}
  key_rank = [rank.setdefault(k, len(rank)) for k in keys] if keys is not None else [0] * n
  size = [float(x) for x in sizes] if sizes is not None else [0.0] * n
  cap = slack * sum(size) / num_devices + max(size, default=0.0)
  loads, held = [0.0] * num_devices, [0.0] * num_devices
  shares: list[list[int]] = [[] for _ in range(num_devices)]
  for i in sorted(range(n), key=lambda i: (-costs[i], key_rank[i], i)):
    fits = [d for d in range(num_devices) if held[d] + size[i] <= cap]
    d = min(fits or range(num_devices), key=lambda d: (loads[d], len(shares[d]), held[d], d))
    shares[d].append(i)
    loads[d] += costs[i]
    held[d] += size[i]
  return tuple(tuple(sorted(s)) for s in shares)


def refresh_assignment(factor_shapes, num_devices: int, sizes=None) -> Shares:
  """`assign` by `factorisation_cost`, equal shapes one key, bytes capped by `sizes`."""
  shapes = [tuple(tuple(int(n) for n in s) for s in f) for f in factor_shapes]
  return assign([factorisation_cost(f) for f in shapes], num_devices, sizes=sizes, keys=shapes)


def check_auto_axis(mesh, axis: str) -> None:
  """Raises unless `axis` of `mesh` is automatic (an explicit one cannot type the split work)."""
  if mesh.axis_types[mesh.axis_names.index(axis)] == jax.sharding.AxisType.Explicit:
    raise ValueError(
      f"`config.mesh`: axis {axis!r} of the mesh is AxisType.Explicit; the inverses split over "
      "an AxisType.Auto axis only: make it Auto, or drop `config.mesh` (and sharded storage)."
    )


class ShardedCache(NamedTuple):
  """Per-block state under `inverse_storage="sharded"`: each device's share, raveled and
  zero-padded to the longest share's length L.

  Attributes:
    buffers: per dtype name, one flat buffer: `[L]` inside pmap / shard_map, `[D, L]` as a pmap
      output, `[D·L]` sharded over the mesh axis under jit.
  """

  buffers: dict[str, Array]


class Slot(NamedTuple):
  """Where leaf `leaf` of block `block`'s state sits in its device's buffer."""

  block: int
  leaf: int
  dtype: str
  offset: int
  shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """Static placement of every block's state (factors or cache) on `len(shares)` devices."""

  shares: Shares
  slots: tuple[tuple[Slot, ...], ...]  # Per device, the `Slot`s of its blocks' arrays.
  lengths: tuple[tuple[str, int], ...]  # Per dtype name, the buffer length L (at least 1).
  treedefs: tuple[Any, ...]  # Per block, the structure of its state.


def packed_layout(shapes: Sequence[Any], shares: Shares) -> PackedLayout:
  """Places per-block arrays (`jax.ShapeDtypeStruct` trees) in per-dtype device buffers."""
  flat = [jax.tree_util.tree_flatten(c) for c in shapes]
  slots: list[tuple[Slot, ...]] = []
  lengths: dict[str, int] = {np.dtype(s.dtype).name: 1 for leaves, _ in flat for s in leaves}
  for share in shares:
    offsets: dict[str, int] = {}
    mine = []
    for i in share:
      for k, s in enumerate(flat[i][0]):
        dtype = np.dtype(s.dtype).name
        mine.append(Slot(i, k, dtype, offsets.get(dtype, 0), tuple(s.shape)))
        offsets[dtype] = offsets.get(dtype, 0) + math.prod(s.shape)
    slots.append(tuple(mine))
    lengths.update((d, max(lengths[d], n)) for d, n in offsets.items())
  treedefs = tuple(treedef for _, treedef in flat)
  return PackedLayout(shares, tuple(slots), tuple(sorted(lengths.items())), treedefs)


def pack(layout: PackedLayout, device: int, caches: dict[int, Any]) -> dict[str, Array]:
  """Device `device`'s buffers from its blocks' states (`{block index: state}`), zero-padded."""
  parts: dict[str, list[Array]] = {d: [] for d, _ in layout.lengths}
  leaves = {i: jax.tree_util.tree_leaves(c) for i, c in caches.items()}
  for s in layout.slots[device]:
    parts[s.dtype].append(jnp.ravel(leaves[s.block][s.leaf]).astype(s.dtype))
  for dtype, length in layout.lengths:
    parts[dtype].append(jnp.zeros((length - sum(p.size for p in parts[dtype]),), dtype))
  return {dtype: jnp.concatenate(p) for dtype, p in parts.items()}


def unpack(layout: PackedLayout, device: int, buffers: dict[str, Array]) -> dict[int, Any]:
  """Inverse of `pack`: `{block index: state}` for device `device`'s blocks."""
  leaves: dict[int, list[Array]] = {i: [] for i in layout.shares[device]}
  for s in layout.slots[device]:  # In each block's leaf order.
    size = math.prod(s.shape)
    leaves[s.block].append(buffers[s.dtype][s.offset : s.offset + size].reshape(s.shape))
  return {i: jax.tree_util.tree_unflatten(layout.treedefs[i], v) for i, v in leaves.items()}


def on_own_share(fn: Callable[[int], Any], shares: Sequence[Sequence[int]], axis_name: str) -> Any:
  """`fn(device)` on each device of `axis_name`, `device` static; idle ones share a branch."""
  busy = [d for d, share in enumerate(shares) if share]
  idle = [d for d, share in enumerate(shares) if not share]
  branches = [lambda d=d: fn(d) for d in busy + idle[:1]]
  if len(branches) == 1:
    return branches[0]()
  table = [busy.index(d) if d in busy else len(busy) for d in range(len(shares))]
  return jax.lax.switch(jnp.asarray(table, jnp.int32)[jax.lax.axis_index(axis_name)], branches)


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


def over_mesh(fn: Callable[..., Any], mesh, args: tuple, sharded: tuple[bool, ...], out_sharded):
  """`fn(axis, *args)` inside a `shard_map` over one axis of `mesh`; the arguments flagged in
  `sharded` (and outputs in the `out_sharded` prefix tree) split over it, the others replicated."""
  m, axis = mesh_axis(mesh)
  rep, split = jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(axis)
  spec = lambda s: split if s else rep
  return jax.shard_map(
    lambda *a: fn(axis, *a),
    mesh=m,
    in_specs=tuple(spec(s) for s in sharded),
    out_specs=jax.tree_util.tree_map(spec, out_sharded),
    axis_names=frozenset({axis}),
    check_vma=False,
  )(*args)


def explicit_axes_as_auto(fn: Callable[..., Any], *args: Any, like: Any = None) -> Any:
  """`fn(*args)`, also under a mesh with explicit axes, which it makes automatic (XLA places
  the reductions over them); the outputs are replicated, or sharded as the leaves of `like`."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not mesh.explicit_axes:
    return fn(*args)
  out = jax.sharding.PartitionSpec()
  if like is not None:
    out = jax.tree_util.tree_map(lambda x: jax.typeof(x).sharding.spec, like)
  return jax.sharding.auto_axes(fn, axes=mesh.explicit_axes, out_sharding=out)(*args)


def vdot(x: Array, y: Array) -> Array:
  """`jnp.vdot(x, y)`, also for operands sharded over explicit mesh axes (a replicated scalar)."""
  return explicit_axes_as_auto(jnp.vdot, x, y)


def replicate_on_mesh(tree, params, mesh) -> Any:
  """`tree` with each concrete single-device array replicated over `mesh` (or the mesh of a
  `params` leaf's `NamedSharding`), so that the second jitted step reuses the first's program."""
  concrete = lambda x: isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
  if mesh is None:
    shardings = (x.sharding for x in jax.tree_util.tree_leaves(params) if concrete(x))
    named = (s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding))
    mesh = next(((m, None) for m in named), None)
  if mesh is None:
    return tree
  every = jax.sharding.NamedSharding(mesh[0], jax.sharding.PartitionSpec())
  single = lambda x: concrete(x) and isinstance(x.sharding, jax.sharding.SingleDeviceSharding)
  return jax.tree_util.tree_map(lambda x: jax.device_put(x, every) if single(x) else x, tree)

"""Where the block caches live on a data-parallel axis: two strategy objects, one interface.

`ReplicatedStorage` (the default) and `ShardedStorage` each take a fixed list of blocks and
initialise, refresh and multiply by their caches; the estimator calls them without knowing
which it holds. With replicated storage every device holds every block's cache (inverses,
eigendecompositions, Cholesky factors): the factorisations may be split over the devices, but
their results are summed over the axis so that each device can precondition the whole gradient
locally. With sharded storage (the "memory-optimised" strategy of KAISA, Pauloski et al., 2021)
device d stores and refreshes only the caches of its share S_d of the blocks, and
preconditions only their gradient leaves; the full update is then the sum over the axis of each
device's zero-padded part,

    u = Σ_d  [ (F̂_b + λ)⁻¹ g_b  for b ∈ S_d,  0 elsewhere ],

one `psum` of a gradient-sized vector per step. Each entry of the sum has a single non-zero
term, so `u` is exactly what a device holding every cache computes. The factors (EMA
statistics) stay replicated: every device updates them, so no statistics are communicated
beyond the usual average.

Shares are balanced by cache bytes (`kfac_jax._parallel.packed_layout`), so each device stores
at most `total/D + one block's cache`. The layout is a static function of the block shapes and
the axis size D, identical on every host.

Both strategies are frozen, field-less objects: the blocks are passed to every call, so one
object serves every estimator; the sharded layout is a pure function of the blocks' cache
shapes and D, memoised.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _checks, _parallel
from kfac_jax import blocks as _blocks

if TYPE_CHECKING:
  from kfac_jax.blocks import Block

Array = jax.Array


def check_axis(axis_name: str | None, mesh, method: str) -> None:
  """Sharded storage needs the axis the caches are split over, on every call."""
  if axis_name is not None and mesh is not None:
    raise ValueError(
      f"`{method}`: pass `axis_name` (inside pmap/shard_map) or `mesh` (under jit), not both."
    )
  if axis_name is None and mesh is None:
    raise ValueError(
      f"`{method}`: with inverse_storage='sharded' each device holds only its share of the "
      "caches, so the call needs the device axis: pass `axis_name=` inside pmap/shard_map, "
      "or `mesh=(mesh, axis)` under jit."
    )


def _bound_size(axis_name: str, method: str) -> int:
  try:
    return jax.lax.axis_size(axis_name)
  except NameError:
    raise ValueError(
      f"`{method}` with inverse_storage='sharded' and axis_name={axis_name!r} must run inside "
      f"pmap/shard_map over {axis_name!r}: each device's state differs. E.g. "
      f"`jax.pmap(tx.init, axis_name={axis_name!r})(replicated_params)`."
    ) from None


def _mesh_size(mesh) -> int:
  m, axis = _parallel.mesh_axis(mesh)
  return int(m.shape[axis])


def _check_buffers(lay: _parallel.PackedLayout, cache, per_device: bool, method: str) -> None:
  if not isinstance(cache, _parallel.ShardedCache):
    raise TypeError(
      f"`{method}`: the state's cache is a {type(cache).__name__}, not the ShardedCache that "
      "inverse_storage='sharded' keeps; initialise the state with this estimator's `init`."
    )
  d = 1 if per_device else lay.num_devices
  want = {k: (n * d,) for k, n in lay.lengths}
  got = {k: tuple(np.shape(v)) for k, v in cache.buffers.items()}
  if got != want:
    raise ValueError(
      f"`{method}`: the sharded cache has buffers {got}, but {lay.num_devices} devices need "
      f"{want} ({'each device' if per_device else 'the global arrays'}). Was the state "
      "initialised for another number of devices? Initialise it on the axis it is used with."
    )


def all_finite(tree) -> Array:
  """True when every entry of every leaf is finite.

  Tested through each leaf's sum, which is finite exactly when no entry is NaN or ±Inf (barring
  a sum that overflows: ~1e38 in float32, then the leaf counts as non-finite, which errs on the
  safe side). A sum compiles to one reduction that XLA fuses with the producer, where an
  elementwise `isfinite` and `all` over every factor and inverse costs far more compile time.
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  return jnp.all(
    jnp.stack(
      [jnp.isfinite(jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32))) for x in leaves]
    )
  )


def _keep_finite(new: dict, old: dict, keys) -> tuple[dict, Array]:
  """Per key, `new[k]` when finite, else `old[k]` (a select on the scalar flag: an elementwise
  `where` fused with the factorisations costs several times more compile time); and the count of
  non-finite ones."""
  kept, failed = {}, jnp.zeros((), jnp.int32)
  for k in keys:
    ok = all_finite(new[k])
    kept[k] = jax.lax.cond(ok, lambda k=k: new[k], lambda k=k: old[k])
    failed = failed + (~ok).astype(jnp.int32)
  return kept, failed


@dataclasses.dataclass(frozen=True)
class ReplicatedStorage:
  """Every device keeps every block's cache (`{block name: cache}`) and preconditions the whole
  gradient itself. With `axis_name` (inside pmap / shard_map) or `mesh` (under jit), each device
  factorises its share of the blocks, balanced by cost, and the caches are summed over the axis
  (an exact operation: every other device contributes zeros)."""

  def check_blocks(self, names: Sequence[str], blocks: Sequence[Block]) -> None:
    del names, blocks  # Every block kind keeps its cache here.

  def init_cache(self, names, blocks, axis_name, mesh) -> dict[str, Any]:
    del axis_name, mesh
    return {n: b.init_cache() for n, b in zip(names, blocks)}

  def refresh(self, names, blocks, factors, cache, damping, axis_name, mesh):
    """`(new cache, number of failed blocks)`; a block whose new cache is not finite keeps its
    previous one. `factors` has one entry per block, in block order."""
    if axis_name is not None and mesh is not None:
      raise ValueError("pass `axis_name` (inside pmap/shard_map) or `mesh` (under jit), not both.")

    def compute(indices, factors, lam):
      new = _blocks.compute_caches(blocks, indices, factors, lam)
      return {names[i]: c for i, c in new.items()}

    if axis_name is None and mesh is None:
      new = compute(range(len(blocks)), factors, damping)
    else:
      costs = [_parallel.factorisation_cost(b.factor_shapes) for b in blocks]
      zeros = jax.tree_util.tree_map(jnp.zeros_like, cache)

      def split(factors, lam, axis):
        return _parallel.split_over_axis(lambda idx: compute(idx, factors, lam), zeros, costs, axis)

      if axis_name is not None:
        new = split(factors, damping, axis_name)
      else:
        new = _parallel.over_mesh_axis(split, mesh, factors, damping)
    return _keep_finite(new, cache, names)

  def apply(self, names, blocks, factors, cache, leaves, fn, axis_name, mesh, method) -> list:
    """`fn(block, factors, cache, vecs)` for every block, into a copy of `leaves`."""
    del axis_name, mesh, method
    out = list(leaves)
    for n, b, f in zip(names, blocks, factors):
      res = fn(b, f, cache[n], [leaves[j] for j in b.spec.leaf_indices])
      for j, r in zip(b.spec.leaf_indices, res):
        out[j] = r
    return out

  def block_cache(self, cache, name: str):
    """The cache of block `name` (for statistics that need it, and `to_dense`)."""
    return cache[name]


@functools.lru_cache(maxsize=64)
def _layout(flat_shapes: tuple, num_devices: int) -> _parallel.PackedLayout:
  shapes = [jax.tree_util.tree_unflatten(treedef, leaves) for leaves, treedef in flat_shapes]
  return _parallel.packed_layout(shapes, num_devices)


@dataclasses.dataclass(frozen=True)
class ShardedStorage:
  """Each device keeps only its share of the blocks' caches (a `ShardedCache`), refreshes and
  applies only those, and the products are summed over the axis; every call needs `axis_name`
  (inside pmap / shard_map) or `mesh` (under jit). See the module docstring."""

  def check_blocks(self, names: Sequence[str], blocks: Sequence[Block]) -> None:
    for n, b in zip(names, blocks):
      if b.needs_cache_for_statistics:
        raise ValueError(
          f"layer `{n}`: approx={b.spec.approx!r} needs its cache for the statistics, "
          "which inverse_storage='sharded' keeps on one device; use "
          "inverse_storage='replicated' or another approximation for it."
        )

  def layout(self, blocks: Sequence[Block], num_devices: int) -> _parallel.PackedLayout:
    """The blocks laid out on `num_devices` devices."""
    flat = (jax.tree_util.tree_flatten(b.cache_shapes()) for b in blocks)
    return _layout(tuple((tuple(leaves), treedef) for leaves, treedef in flat), num_devices)

  def init_cache(self, names, blocks, axis_name, mesh) -> _parallel.ShardedCache:
    """Each device's buffers holding its blocks' initial (identity) caches."""
    del names
    check_axis(axis_name, mesh, "init")

    def local(axis):
      lay = self.layout(blocks, jax.lax.axis_size(axis))
      return _parallel.ShardedCache(
        _parallel.on_own_share(
          lambda d: _parallel.pack(lay, d, {i: blocks[i].init_cache() for i in lay.shares[d]}),
          lay,
          axis,
        )
      )

    if axis_name is not None:
      _bound_size(axis_name, "init")
      return local(axis_name)
    return _parallel.over_mesh(local, mesh, (), (), True)

  def refresh(self, names, blocks, factors, cache, damping, axis_name, mesh):
    """`(new ShardedCache, number of failed blocks)`: each device refreshes its own blocks; the
    failures are counted on the device that owns the block and summed over the axis."""
    del names
    check_axis(axis_name, mesh, "update_inverses")
    if mesh is not None:
      _check_buffers(self.layout(blocks, _mesh_size(mesh)), cache, False, "update_inverses")

    def local(axis, factors, cache, lam):
      lay = self.layout(blocks, jax.lax.axis_size(axis))
      _check_buffers(lay, cache, True, "update_inverses")

      def run(d):
        share = lay.shares[d]
        old = _parallel.unpack(lay, d, cache.buffers)
        new = _blocks.compute_caches(blocks, share, factors, lam)
        kept, failed = _keep_finite(new, old, share)
        return _parallel.pack(lay, d, kept), failed

      buffers, failed = _parallel.on_own_share(run, lay, axis)
      return _parallel.ShardedCache(buffers), jax.lax.psum(failed, axis)

    if axis_name is not None:
      _bound_size(axis_name, "update_inverses")
      return local(axis_name, factors, cache, damping)
    return _parallel.over_mesh(
      local, mesh, (factors, cache, damping), (False, True, False), (True, False)
    )

  def apply(self, names, blocks, factors, cache, leaves, fn, axis_name, mesh, method) -> list:
    """`fn(block, factors, cache, vecs)` for every block, each on the device that owns it.

    Every device computes its blocks' products into a zero vector; the sum over the axis is
    the full product (a single non-zero term per entry, so exact). Leaves outside every block
    pass through unchanged, as with replicated storage.
    """
    del names
    check_axis(axis_name, mesh, method)
    if mesh is not None:
      _check_buffers(self.layout(blocks, _mesh_size(mesh)), cache, False, method)
    covered = sorted(j for b in blocks for j in b.spec.leaf_indices)
    vecs = [leaves[j] for j in covered]

    def spec(x):
      return jax.ShapeDtypeStruct(np.shape(x), x.dtype)

    # The products' shapes and dtypes, which every branch (owner or not) must return.
    out_shapes: dict[int, jax.ShapeDtypeStruct] = {}
    for i, b in enumerate(blocks):
      res = jax.eval_shape(
        lambda f, c, v, b=b: fn(b, f, c, v),
        jax.tree_util.tree_map(spec, factors[i]),
        b.cache_shapes(),
        [spec(leaves[j]) for j in b.spec.leaf_indices],
      )
      out_shapes.update(zip(b.spec.leaf_indices, res))

    def local(axis, factors, cache, vecs):
      lay = self.layout(blocks, jax.lax.axis_size(axis))
      _check_buffers(lay, cache, True, method)
      by_leaf = dict(zip(covered, vecs))

      def run(d):
        caches = _parallel.unpack(lay, d, cache.buffers)
        out = {j: jnp.zeros(out_shapes[j].shape, out_shapes[j].dtype) for j in covered}
        for i in lay.shares[d]:
          b = blocks[i]
          res = fn(b, factors[i], caches[i], [by_leaf[j] for j in b.spec.leaf_indices])
          out.update(zip(b.spec.leaf_indices, res))
        return [out[j] for j in covered]

      return jax.lax.psum(_parallel.on_own_share(run, lay, axis), axis)

    if axis_name is not None:
      _bound_size(axis_name, method)
      res = local(axis_name, factors, cache, vecs)
    else:
      res = _parallel.over_mesh(local, mesh, (factors, cache, vecs), (False, True, False), False)
    out: list[Any] = list(leaves)
    for j, r in zip(covered, res):
      out[j] = r
    return out

  def block_cache(self, cache, name: str):
    del cache, name
    return None


Storage = ReplicatedStorage | ShardedStorage
_BY_NAME: dict[str, Storage] = {"replicated": ReplicatedStorage(), "sharded": ShardedStorage()}


def strategy(value, name: str = "inverse_storage") -> Storage:
  """The storage object for `value`: a `ReplicatedStorage` / `ShardedStorage`, or its name."""
  if isinstance(value, (ReplicatedStorage, ShardedStorage)):
    return value
  _checks.choice(value, name, tuple(_BY_NAME))
  return _BY_NAME[value]

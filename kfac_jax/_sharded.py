"""`inverse_storage="sharded"`: each device keeps only its own blocks' caches (KAISA's strategy).

With the default, replicated storage every device holds every block's cache (inverses,
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
the axis size D, identical on every host. `ShardedStorage` holds what this needs: the blocks and
a function computing their caches (the estimator's batched factorisations); it never sees the
estimator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _parallel

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


class ShardedStorage:
  """Sharded cache storage for a fixed list of blocks.

  Args:
    blocks: the curvature blocks, in state order (block i is entry i of every factors list).
    compute_caches: `compute_caches(indices, factors, damping) -> {index: cache}`: the fresh
      caches of the blocks `indices`, from `factors` (one entry per block, in block order) and
      the damping λ. Blocks of one group may share a batched call; it is pure.
  """

  def __init__(
    self,
    blocks: Sequence[Block],
    compute_caches: Callable[[Sequence[int], Sequence[Any], Array], dict[int, Any]],
  ):
    self.blocks = tuple(blocks)
    self.compute_caches = compute_caches
    self._layouts: dict[int, _parallel.PackedLayout] = {}

  def layout(self, num_devices: int) -> _parallel.PackedLayout:
    """The blocks laid out on `num_devices` devices (memoised per device count)."""
    if num_devices not in self._layouts:
      shapes = [b.cache_shapes() for b in self.blocks]
      self._layouts[num_devices] = _parallel.packed_layout(shapes, num_devices)
    return self._layouts[num_devices]

  def device_bytes(self, num_devices: int) -> int:
    """Cache bytes each device stores on `num_devices` devices."""
    return self.layout(num_devices).device_bytes()

  def init_cache(self, axis_name: str | None, mesh) -> _parallel.ShardedCache:
    """Each device's buffers holding its blocks' initial (identity) caches."""
    check_axis(axis_name, mesh, "init")

    def local(axis):
      lay = self.layout(jax.lax.axis_size(axis))
      return _parallel.ShardedCache(
        _parallel.on_own_share(
          lambda d: _parallel.pack(lay, d, {i: self.blocks[i].init_cache() for i in lay.shares[d]}),
          lay,
          axis,
        )
      )

    if axis_name is not None:
      _bound_size(axis_name, "init")
      return local(axis_name)
    return _parallel.over_mesh(local, mesh, (), (), True)

  def update_inverses(self, cache, factors: Sequence[Any], damping, axis_name, mesh, all_finite):
    """`(new ShardedCache, number of failed blocks)`: each device refreshes its own blocks.

    `factors` has one entry per block, in block order. A block whose new cache is not finite
    (`all_finite(cache)` false) keeps its previous one; the failures are counted on the device
    that owns the block and summed over the axis.
    """
    check_axis(axis_name, mesh, "update_inverses")
    if mesh is not None:
      _check_buffers(self.layout(_mesh_size(mesh)), cache, False, "update_inverses")

    def local(axis, factors, cache, lam):
      lay = self.layout(jax.lax.axis_size(axis))
      _check_buffers(lay, cache, True, "update_inverses")

      def run(d):
        share = lay.shares[d]
        old = _parallel.unpack(lay, d, cache.buffers)
        new = self.compute_caches(share, factors, lam)
        kept, failed = {}, jnp.zeros((), jnp.int32)
        for i in share:
          ok = all_finite(new[i])
          kept[i] = jax.lax.cond(ok, lambda i=i: new[i], lambda i=i: old[i])
          failed = failed + (~ok).astype(jnp.int32)
        return _parallel.pack(lay, d, kept), failed

      buffers, failed = _parallel.on_own_share(run, lay, axis)
      return _parallel.ShardedCache(buffers), jax.lax.psum(failed, axis)

    if axis_name is not None:
      _bound_size(axis_name, "update_inverses")
      return local(axis_name, factors, cache, damping)
    return _parallel.over_mesh(
      local, mesh, (factors, cache, damping), (False, True, False), (True, False)
    )

  def apply(
    self, factors: Sequence[Any], cache, leaves: list[Array], fn, axis_name, mesh, method: str
  ) -> list:
    """`fn(block, factors, cache, vecs)` for every block, each on the device that owns it.

    `factors` has one entry per block, in block order. Every device computes its blocks'
    products into a zero vector; the sum over the axis is the full product (a single non-zero
    term per entry, so exact). Leaves outside every block pass through unchanged, as with
    replicated storage.
    """
    check_axis(axis_name, mesh, method)
    if mesh is not None:
      _check_buffers(self.layout(_mesh_size(mesh)), cache, False, method)
    blocks = self.blocks
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
      lay = self.layout(jax.lax.axis_size(axis))
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

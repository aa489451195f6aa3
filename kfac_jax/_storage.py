"""Where the block state lives on a data-parallel axis: two strategy objects, one interface.

`ReplicatedStorage` (the default) and `ShardedStorage` each take a fixed list of blocks and
initialise, fold statistics into, refresh and multiply by their state; the estimator calls them
without knowing which it holds. With replicated storage every device holds every block's
factors and cache (inverses, eigendecompositions, Cholesky factors): the factorisations may be
split over the devices, but their results are summed over the axis so that each device can
precondition the whole gradient locally. With sharded storage (the "memory-optimised" strategy
of KAISA, Pauloski et al., 2021, applied to the factors as well, as FSDP does to the
parameters) device d stores, updates and refreshes only the factors and caches of its share
S_d of the blocks, and preconditions only their gradient leaves; the full update is then the
sum over the axis of each device's zero-padded part,

    u = Σ_d  [ (F̂_b + λ)⁻¹ g_b  for b ∈ S_d,  0 elsewhere ],

one `psum` of a gradient-sized vector per step. Each entry of the sum has a single non-zero
term, so `u` is exactly what a device holding every cache computes. The batch statistics are
averaged over the axis as with replicated storage; each device folds only its blocks' into its
factors, so a refresh needs no communication at all.

Shares are balanced by refresh cost and capped in bytes (`kfac_jax._parallel.refresh_assignment`):
each device does about 1/D of the factorisation work and stores at most
`1.25 · total/D + one block's state`. The layout is a static function of the block shapes and
the axis size D, identical on every host.

Both strategies are frozen, field-less objects: the blocks are passed to every call, so one
object serves every estimator; the sharded layout is a pure function of the blocks' state
shapes and D, memoised.
"""

from __future__ import annotations

import dataclasses
import functools
import math
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
      "factors and caches, so the call needs the device axis: pass `axis_name=` inside "
      "pmap/shard_map, or `mesh=(mesh, axis)` under jit."
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


def _check_buffers(
  lay: _parallel.PackedLayout, state, per_device: bool, method: str, field: str = "cache"
) -> None:
  if not isinstance(state, _parallel.ShardedCache):
    raise TypeError(
      f"`{method}`: the state's {field} is a {type(state).__name__}, not the ShardedCache that "
      "inverse_storage='sharded' keeps; initialise the state with this estimator's `init`."
    )
  d = 1 if per_device else lay.num_devices
  want = {k: (n * d,) for k, n in lay.lengths}
  got = {k: tuple(np.shape(v)) for k, v in state.buffers.items()}
  if got != want:
    raise ValueError(
      f"`{method}`: the sharded {field} has buffers {got}, but {lay.num_devices} devices need "
      f"{want} ({'each device' if per_device else 'the global arrays'}). Was the state "
      "initialised for another number of devices? Initialise it on the axis it is used with."
    )


def _in_inverse_dtype(block: Block, factors):
  """A block's factors cast to its `inverse_dtype` (no-op when the dtypes agree)."""
  dtype = block.config.inverse_dtype
  return jax.tree_util.tree_map(lambda x: x if x.dtype == dtype else x.astype(dtype), factors)


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
  """Every device keeps every block's factors and cache (`{block name: ...}`) and preconditions
  the whole gradient itself. With `axis_name` (inside pmap / shard_map) or `mesh` (under jit),
  each device factorises its share of the blocks, balanced by cost, and the caches are summed
  over the axis (an exact operation: every other device contributes zeros)."""

  def check_blocks(self, names: Sequence[str], blocks: Sequence[Block]) -> None:
    del names, blocks  # Every block kind keeps its cache here.

  def init_state(self, names, blocks, axis_name, mesh) -> tuple[dict, dict]:
    """`(factors, cache)`: zero statistics and identity caches, per block name."""
    del axis_name, mesh
    return (
      {n: b.init_factors() for n, b in zip(names, blocks)},
      {n: b.init_cache() for n, b in zip(names, blocks)},
    )

  def fold(self, names, blocks, factors, new, weight, average, axis_name, mesh) -> dict:
    """`average(old, batch, weight)` leaf by leaf; `new` has one entry per block, in order."""
    del blocks, axis_name, mesh
    return {
      n: jax.tree_util.tree_map(lambda o, b: average(o, b, weight), factors[n], x)
      for n, x in zip(names, new)
    }

  def refresh(self, names, blocks, factors, cache, damping, axis_name, mesh):
    """`(new cache, number of failed blocks)`; a block whose new cache is not finite keeps its
    previous one."""
    if axis_name is not None and mesh is not None:
      raise ValueError("pass `axis_name` (inside pmap/shard_map) or `mesh` (under jit), not both.")
    by_block = [factors[n] for n in names]

    def compute(indices, factors, lam):
      new = _blocks.compute_caches(blocks, indices, factors, lam)
      return {names[i]: c for i, c in new.items()}

    if axis_name is None and mesh is None:
      new = compute(range(len(blocks)), by_block, damping)
    else:
      shapes = [b.factor_shapes for b in blocks]
      zeros = jax.tree_util.tree_map(jnp.zeros_like, cache)

      def split(factors, lam, axis):
        return _parallel.split_over_axis(
          lambda idx: compute(idx, factors, lam), zeros, shapes, axis
        )

      if axis_name is not None:
        new = split(by_block, damping, axis_name)
      else:
        new = _parallel.over_mesh_axis(split, mesh, by_block, damping)
    return _keep_finite(new, cache, names)

  def apply(self, names, blocks, factors, cache, leaves, fn, axis_name, mesh, method) -> list:
    """`fn(block, factors, cache, vecs)` for every block, into a copy of `leaves`."""
    del axis_name, mesh, method
    out = list(leaves)
    for n, b in zip(names, blocks):
      f = _in_inverse_dtype(b, factors[n])
      res = fn(b, f, cache[n], [leaves[j] for j in b.spec.leaf_indices])
      for j, r in zip(b.spec.leaf_indices, res):
        out[j] = r
    return out

  def block_cache(self, cache, name: str):
    """The cache of block `name` (for statistics that need it, and `to_dense`)."""
    return cache[name]

  def block_factors(self, names, blocks, factors) -> dict[str, Any]:
    """Every block's factors by name (for `to_dense`)."""
    del names, blocks
    return factors


def _shapes(tree) -> tuple:
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return tuple(leaves), treedef


def _layout_key(blocks: Sequence[Block]) -> tuple[tuple, tuple, tuple]:
  """What the sharded layout depends on: each block's factor and cache shapes."""
  return (
    tuple(_shapes(jax.eval_shape(b.init_factors)) for b in blocks),
    tuple(_shapes(b.cache_shapes()) for b in blocks),
    tuple(tuple(b.factor_shapes) for b in blocks),
  )


@functools.lru_cache(maxsize=64)
def _layouts(
  factors: tuple, caches: tuple, factor_shapes: tuple, num_devices: int
) -> tuple[_parallel.PackedLayout, _parallel.PackedLayout]:
  f = [jax.tree_util.tree_unflatten(treedef, leaves) for leaves, treedef in factors]
  c = [jax.tree_util.tree_unflatten(treedef, leaves) for leaves, treedef in caches]
  sizes = [
    float(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in fl + cl))
    for (fl, _), (cl, _) in zip(factors, caches)
  ]
  shares = _parallel.refresh_assignment(factor_shapes, num_devices, sizes)
  return (
    _parallel.packed_layout(f, num_devices, shares),
    _parallel.packed_layout(c, num_devices, shares),
  )


@dataclasses.dataclass(frozen=True)
class ShardedStorage:
  """Each device keeps only its share of the blocks' factors and caches (two `ShardedCache`s),
  folds statistics into, refreshes and applies only those, and the products are summed over
  the axis; every call needs `axis_name` (inside pmap / shard_map) or `mesh` (under jit). See
  the module docstring."""

  def check_blocks(self, names: Sequence[str], blocks: Sequence[Block]) -> None:
    for n, b in zip(names, blocks):
      if b.needs_cache_for_statistics:
        raise ValueError(
          f"layer `{n}`: approx={b.spec.approx!r} needs its cache for the statistics, "
          "which inverse_storage='sharded' keeps on one device; use "
          "inverse_storage='replicated' or another approximation for it."
        )

  def layouts(
    self, blocks: Sequence[Block], num_devices: int
  ) -> tuple[_parallel.PackedLayout, _parallel.PackedLayout]:
    """The blocks' factors and caches laid out on `num_devices` devices (the same shares)."""
    return _layouts(*_layout_key(blocks), num_devices)

  def _check_global(self, blocks, mesh, method, factors=None, cache=None) -> None:
    if mesh is None:
      return
    flay, clay = self.layouts(blocks, _mesh_size(mesh))
    if factors is not None:
      _check_buffers(flay, factors, False, method, "factors")
    if cache is not None:
      _check_buffers(clay, cache, False, method)

  def init_state(self, names, blocks, axis_name, mesh):
    """`(factors, cache)`: each device's buffers holding its blocks' zero factors and identity
    caches."""
    del names
    check_axis(axis_name, mesh, "init")

    def local(axis):
      flay, clay = self.layouts(blocks, jax.lax.axis_size(axis))

      def run(d):
        share = flay.shares[d]
        return (
          _parallel.pack(flay, d, {i: blocks[i].init_factors() for i in share}),
          _parallel.pack(clay, d, {i: blocks[i].init_cache() for i in share}),
        )

      f, c = _parallel.on_own_share(run, flay, axis)
      return _parallel.ShardedCache(f), _parallel.ShardedCache(c)

    if axis_name is not None:
      _bound_size(axis_name, "init")
      return local(axis_name)
    return _parallel.over_mesh(local, mesh, (), (), (True, True))

  def fold(self, names, blocks, factors, new, weight, average, axis_name, mesh):
    """Each device folds its blocks' entries of this batch's statistics `new` (one entry per
    block, in order, the same on every device) into its factors: `average(old, batch,
    weight)` leaf by leaf."""
    del names
    method = "update_curvature"
    check_axis(axis_name, mesh, method)
    self._check_global(blocks, mesh, method, factors=factors)

    def local(axis, factors, new, weight):
      flay, _ = self.layouts(blocks, jax.lax.axis_size(axis))
      _check_buffers(flay, factors, True, method, "factors")

      def run(d):
        old = _parallel.unpack(flay, d, factors.buffers)
        return _parallel.pack(
          flay,
          d,
          {
            i: jax.tree_util.tree_map(lambda o, b: average(o, b, weight), old[i], new[i])
            for i in flay.shares[d]
          },
        )

      return _parallel.ShardedCache(_parallel.on_own_share(run, flay, axis))

    if axis_name is not None:
      _bound_size(axis_name, method)
      return local(axis_name, factors, new, weight)
    return _parallel.over_mesh(local, mesh, (factors, new, weight), (True, False, False), True)

  def refresh(self, names, blocks, factors, cache, damping, axis_name, mesh):
    """`(new ShardedCache, number of failed blocks)`: each device refreshes its own blocks from
    its own factors; the failures are counted on the device that owns the block and summed over
    the axis."""
    del names
    method = "update_inverses"
    check_axis(axis_name, mesh, method)
    self._check_global(blocks, mesh, method, factors=factors, cache=cache)

    def local(axis, factors, cache, lam):
      flay, clay = self.layouts(blocks, jax.lax.axis_size(axis))
      _check_buffers(flay, factors, True, method, "factors")
      _check_buffers(clay, cache, True, method)

      def run(d):
        share = clay.shares[d]
        old = _parallel.unpack(clay, d, cache.buffers)
        mine = _parallel.unpack(flay, d, factors.buffers)
        new = _blocks.compute_caches(blocks, share, [mine.get(i) for i in range(len(blocks))], lam)
        kept, failed = _keep_finite(new, old, share)
        return _parallel.pack(clay, d, kept), failed

      buffers, failed = _parallel.on_own_share(run, clay, axis)
      return _parallel.ShardedCache(buffers), jax.lax.psum(failed, axis)

    if axis_name is not None:
      _bound_size(axis_name, method)
      return local(axis_name, factors, cache, damping)
    return _parallel.over_mesh(
      local, mesh, (factors, cache, damping), (True, True, False), (True, False)
    )

  def apply(self, names, blocks, factors, cache, leaves, fn, axis_name, mesh, method) -> list:
    """`fn(block, factors, cache, vecs)` for every block, each on the device that owns it.

    Every device computes its blocks' products into a zero vector; the sum over the axis is
    the full product (a single non-zero term per entry, so exact). Leaves outside every block
    pass through unchanged, as with replicated storage.
    """
    del names
    check_axis(axis_name, mesh, method)
    self._check_global(blocks, mesh, method, factors=factors, cache=cache)
    covered = sorted(j for b in blocks for j in b.spec.leaf_indices)
    vecs = [leaves[j] for j in covered]

    def spec(x):
      return jax.ShapeDtypeStruct(np.shape(x), x.dtype)

    # The products' shapes and dtypes, which every branch (owner or not) must return.
    out_shapes: dict[int, jax.ShapeDtypeStruct] = {}
    for b in blocks:
      res = jax.eval_shape(
        lambda c, v, b=b: fn(b, _in_inverse_dtype(b, b.init_factors()), c, v),
        b.cache_shapes(),
        [spec(leaves[j]) for j in b.spec.leaf_indices],
      )
      out_shapes.update(zip(b.spec.leaf_indices, res))

    def local(axis, factors, cache, vecs):
      flay, clay = self.layouts(blocks, jax.lax.axis_size(axis))
      _check_buffers(flay, factors, True, method, "factors")
      _check_buffers(clay, cache, True, method)
      by_leaf = dict(zip(covered, vecs))

      def run(d):
        caches = _parallel.unpack(clay, d, cache.buffers)
        mine = _parallel.unpack(flay, d, factors.buffers)
        out = {j: jnp.zeros(out_shapes[j].shape, out_shapes[j].dtype) for j in covered}
        for i in clay.shares[d]:
          b = blocks[i]
          f = _in_inverse_dtype(b, mine[i])
          res = fn(b, f, caches[i], [by_leaf[j] for j in b.spec.leaf_indices])
          out.update(zip(b.spec.leaf_indices, res))
        return [out[j] for j in covered]

      return jax.lax.psum(_parallel.on_own_share(run, clay, axis), axis)

    if axis_name is not None:
      _bound_size(axis_name, method)
      res = local(axis_name, factors, cache, vecs)
    else:
      res = _parallel.over_mesh(local, mesh, (factors, cache, vecs), (True, True, False), False)
    out: list[Any] = list(leaves)
    for j, r in zip(covered, res):
      out[j] = r
    return out

  def block_cache(self, cache, name: str):
    del cache, name
    return None

  def block_factors(self, names, blocks, factors) -> dict[str, Any]:
    """Every block's factors by name, gathered from the global buffers (a pmap output
    `[D, L]`, or a `[D·L]` array under jit with a mesh)."""
    if not isinstance(factors, _parallel.ShardedCache):
      raise TypeError(
        f"the state's factors are a {type(factors).__name__}, not the ShardedCache that "
        "inverse_storage='sharded' keeps; initialise the state with this estimator's `init`."
      )
    bufs = factors.buffers
    lens = {k: int(np.size(v)) for k, v in bufs.items()}

    key = _layout_key(blocks)

    def fits(d: int) -> bool:
      return {k: n * d for k, n in _layouts(*key, d)[0].lengths} == lens

    rows = {int(np.shape(v)[0]) for v in bufs.values() if np.ndim(v) == 2}
    first = min(lens.values())
    candidates = rows or [d for d in range(1, first + 1) if first % d == 0]
    num = next((d for d in candidates if fits(d)), None)
    if num is None:
      raise ValueError(
        "the sharded factors' buffers fit no number of devices: pass the global state (as "
        "`init` returned it under pmap or with `mesh`), not one device's share of it."
      )
    flay = _layouts(*key, num)[0]
    out: dict[str, Any] = {}
    for d in range(num):
      local = {k: jnp.reshape(v, (num, -1))[d] for k, v in bufs.items()}
      for i, f in _parallel.unpack(flay, d, local).items():
        out[names[i]] = f
    return out


Storage = ReplicatedStorage | ShardedStorage
_BY_NAME: dict[str, Storage] = {"replicated": ReplicatedStorage(), "sharded": ShardedStorage()}


def strategy(value, name: str = "inverse_storage") -> Storage:
  """The storage object for `value`: a `ReplicatedStorage` / `ShardedStorage`, or its name."""
  if isinstance(value, (ReplicatedStorage, ShardedStorage)):
    return value
  _checks.choice(value, name, tuple(_BY_NAME))
  return _BY_NAME[value]

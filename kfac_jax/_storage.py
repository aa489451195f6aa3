"""Where the block state lives on a data-parallel axis: two strategy objects, one interface.

`ReplicatedStorage` (the default) and `ShardedStorage` take the blocks on every call and
initialise, fold statistics into, refresh and multiply by their state. Replicated: every device
holds every block's factors and cache; the refresh may be split over the devices, its results
summed over the axis (`kfac_jax._parallel`). Sharded (KAISA's "memory-optimised" strategy,
Pauloski et al., 2021, applied to the factors as well, as FSDP does to the parameters): device
d keeps, folds and refreshes only its share S_d of the blocks and the update is

    u = Σ_d  [ (F̂_b + λ)⁻¹ g_b  for b ∈ S_d,  0 elsewhere ],

one `psum` of a gradient-sized vector per step, exact (one non-zero term per entry). Shares are
balanced by refresh cost and capped in bytes (`_parallel.refresh_assignment`), a static
function of the blocks and the axis size D, identical on every host.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

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


def _check_sharded(state, method: str, field: str) -> None:
  if not isinstance(state, _parallel.ShardedCache):
    raise TypeError(
      f"`{method}`: the state's {field} is a {type(state).__name__}, not the ShardedCache that "
      "inverse_storage='sharded' keeps; initialise the state with this estimator's `init`."
    )


def _check_buffers(
  lay: _parallel.PackedLayout, state, per_device: bool, method: str, field: str
) -> None:
  _check_sharded(state, method, field)
  d = 1 if per_device else lay.num_devices
  want = {k: (n * d,) for k, n in lay.lengths}
  got = {k: tuple(np.shape(v)) for k, v in state.buffers.items()}
  if got != want:
    raise ValueError(
      f"`{method}`: the sharded {field} has buffers {got}, but {lay.num_devices} devices need "
      f"{want} ({'each device' if per_device else 'the global arrays'}). Was the state "
      "initialised for another number of devices? Initialise it on the axis it is used with."
    )


def all_finite(tree) -> Array:
  """True when every entry of every leaf is finite.

  Tested through each leaf's sum (finite exactly when no entry is NaN or ±Inf, barring an
  overflow, which errs on the safe side): one reduction XLA fuses with the producer, far cheaper
  to compile than an elementwise `isfinite` over every factor.
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
  """Per key, `new[k]` when finite, else `old[k]` (a select on the scalar flag, cheaper to
  compile than an elementwise `where`); and `[len(keys)]` bool, the keys whose new value was
  not."""
  kept, failed = {}, []
  for k in keys:
    ok = all_finite(new[k])
    kept[k] = jax.lax.cond(ok, lambda k=k: new[k], lambda k=k: old[k])
    failed.append(~ok)
  return kept, jnp.stack(failed) if failed else jnp.zeros((0,), bool)


def _fold(old, new, weight, average):
  return jax.tree_util.tree_map(lambda o, b: average(o, b, weight), old, new)


def _products(blocks, indices, factors, caches, leaves, fn) -> dict[int, Any]:
  """`{leaf index: product}`: `fn(block, factors, cache, vecs)` for the blocks `indices`, each
  block's factors cast to its `inverse_dtype`."""
  out: dict[int, Any] = {}
  for i in indices:
    b = blocks[i]
    f = optax.tree_utils.tree_cast(factors[i], b.config.inverse_dtype)
    vecs = [leaves[j] for j in b.spec.leaf_indices]
    out.update(zip(b.spec.leaf_indices, fn(b, f, caches[i], vecs)))
  return out


@dataclasses.dataclass(frozen=True)
class ReplicatedStorage:
  """Every device keeps every block's factors and cache (`{block name: ...}`) and preconditions
  the whole gradient; with `axis_name` or `mesh` the refresh is split over the devices."""

  def check_blocks(self, names: Sequence[str], blocks: Sequence[Block]) -> None:
    del names, blocks  # Every block kind keeps its cache here.

  def init_state(self, names, blocks, axis_name, mesh) -> tuple[dict, dict]:
    """`(factors, cache)`: zero statistics and identity caches, per block name, made by one
    program: made op by op, each zeros and identity of a new shape would compile on its own."""
    del axis_name, mesh

    def make():
      return (
        {n: b.init_factors() for n, b in zip(names, blocks)},
        {n: b.init_cache() for n, b in zip(names, blocks)},
      )

    return jax.jit(make)()

  def fold(self, names, blocks, factors, new, weight, average, axis_name, mesh) -> dict:
    """`average(old, batch, weight)` leaf by leaf; `new` has one entry per block, in order."""
    del blocks, axis_name, mesh
    return {n: _fold(factors[n], x, weight, average) for n, x in zip(names, new)}

  def refresh(self, names, blocks, factors, cache, damping, axis_name, mesh):
    """`(new cache, failed)`, `failed` `[len(blocks)]` bool: the blocks whose new cache was not
    finite, each of which keeps its previous one."""
    by_block = [factors[n] for n in names]

    def compute(indices, factors, lam):
      new = _blocks.compute_caches(blocks, indices, factors, lam)
      return {names[i]: c for i, c in new.items()}

    def split(axis, factors, lam):  # Each device its share; the others' entries are zeros.
      shares = _parallel.refresh_assignment(
        [b.factor_shapes for b in blocks], jax.lax.axis_size(axis)
      )
      mine = _parallel.on_own_share(
        lambda d: {**zeros, **compute(shares[d], factors, lam)}, shares, axis
      )
      return jax.lax.psum(mine, axis)

    zeros = optax.tree_utils.tree_zeros_like(cache)
    if axis_name is not None:
      new = split(axis_name, by_block, damping)
    elif mesh is not None:
      new = _parallel.over_mesh(split, mesh, (by_block, damping), (False, False), False)
    else:
      new = compute(range(len(blocks)), by_block, damping)
    return _keep_finite(new, cache, names)

  def apply(self, names, blocks, factors, cache, leaves, fn, axis_name, mesh, method) -> list:
    """`fn(block, factors, cache, vecs)` for every block, into a copy of `leaves`."""
    del axis_name, mesh, method
    out = list(leaves)
    f, c = [factors[n] for n in names], [cache[n] for n in names]
    for j, r in _products(blocks, range(len(blocks)), f, c, leaves, fn).items():
      out[j] = r
    return out

  def block_cache(self, cache, name: str):
    """The cache of block `name` (for statistics that need it, and `to_dense`)."""
    return cache[name]

  def block_factors(self, names, blocks, factors) -> dict[str, Any]:
    """Every block's factors by name (for `to_dense`)."""
    del names, blocks
    return factors


@functools.lru_cache(maxsize=64)
def _layouts(
  blocks: tuple[Block, ...], num_devices: int
) -> tuple[_parallel.PackedLayout, _parallel.PackedLayout]:
  shares = _parallel.refresh_assignment(
    [b.factor_shapes for b in blocks], num_devices, [b.state_bytes() for b in blocks]
  )
  return (
    _parallel.packed_layout([jax.eval_shape(b.init_factors) for b in blocks], shares),
    _parallel.packed_layout([b.cache_shapes() for b in blocks], shares),
  )


@dataclasses.dataclass(frozen=True)
class ShardedStorage:
  """Each device keeps, folds, refreshes and applies only its share of the blocks (two
  `ShardedCache`s); every call needs `axis_name` (inside pmap / shard_map) or `mesh` (under
  jit). See the module docstring."""

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
    return _layouts(tuple(blocks), num_devices)

  def _run(self, blocks, method, axis_name, mesh, local, args, sharded, out_sharded):
    """`local(axis, factors layout, cache layout, *args)` on every device of the axis: bound
    (`axis_name`), or of a `shard_map` over `mesh` with the `sharded` arguments and outputs
    split over it. The `sharded` arguments (the state's factors, then its cache) are checked
    against the layouts first."""
    check_axis(axis_name, mesh, method)
    if axis_name is not None:
      size = _bound_size(axis_name, method)
    else:
      m, axis = _parallel.mesh_axis(mesh)
      size = int(m.shape[axis])
    lays = self.layouts(blocks, size)
    for lay, state, field in zip(lays, args[: sum(sharded)], ("factors", "cache")):
      _check_buffers(lay, state, axis_name is not None, method, field)
    if axis_name is not None:
      return local(axis_name, *lays, *args)
    return _parallel.over_mesh(
      lambda axis, *a: local(axis, *lays, *a), mesh, args, sharded, out_sharded
    )

  def init_state(self, names, blocks, axis_name, mesh):
    """`(factors, cache)`: each device's buffers of its blocks' zero factors, identity caches."""
    del names

    def local(axis, flay, clay):
      def run(d):
        share = flay.shares[d]
        return (
          _parallel.pack(flay, d, {i: blocks[i].init_factors() for i in share}),
          _parallel.pack(clay, d, {i: blocks[i].init_cache() for i in share}),
        )

      f, c = _parallel.on_own_share(run, flay.shares, axis)
      return _parallel.ShardedCache(f), _parallel.ShardedCache(c)

    return self._run(blocks, "init", axis_name, mesh, local, (), (), (True, True))

  def fold(self, names, blocks, factors, new, weight, average, axis_name, mesh):
    """Each device folds its blocks' entries of this batch's statistics `new` (one entry per
    block, in order, the same on every device) into its factors: `average(old, batch,
    weight)` leaf by leaf."""
    del names

    def local(axis, flay, clay, factors, new, weight):
      def run(d):
        old = _parallel.unpack(flay, d, factors.buffers)
        return _parallel.pack(
          flay, d, {i: _fold(old[i], new[i], weight, average) for i in flay.shares[d]}
        )

      return _parallel.ShardedCache(_parallel.on_own_share(run, flay.shares, axis))

    args = (factors, new, weight)
    return self._run(
      blocks, "update_curvature", axis_name, mesh, local, args, (True, False, False), True
    )

  def refresh(self, names, blocks, factors, cache, damping, axis_name, mesh):
    """`(new ShardedCache, failed)`: each device refreshes its own blocks from its own factors;
    a failure (`failed`, `[len(blocks)]` bool, as `ReplicatedStorage.refresh`'s) is flagged on
    the device that owns the block and summed over the axis."""
    del names

    def local(axis, flay, clay, factors, cache, lam):
      def run(d):
        share = clay.shares[d]
        old = _parallel.unpack(clay, d, cache.buffers)
        mine = _parallel.unpack(flay, d, factors.buffers)
        new = _blocks.compute_caches(blocks, share, [mine.get(i) for i in range(len(blocks))], lam)
        kept, failed = _keep_finite(new, old, share)
        flags = jnp.zeros((len(blocks),), jnp.int32)
        if share:
          flags = flags.at[np.asarray(share)].set(failed.astype(jnp.int32))
        return _parallel.pack(clay, d, kept), flags

      buffers, failed = _parallel.on_own_share(run, clay.shares, axis)
      return _parallel.ShardedCache(buffers), jax.lax.psum(failed, axis) > 0

    args = (factors, cache, damping)
    return self._run(
      blocks, "update_inverses", axis_name, mesh, local, args, (True, True, False), (True, False)
    )

  def apply(self, names, blocks, factors, cache, leaves, fn, axis_name, mesh, method) -> list:
    """`fn(block, factors, cache, vecs)` for every block on the device that owns it, into
    zeros elsewhere, summed over the axis; leaves outside every block pass through."""
    del names
    covered = sorted(j for b in blocks for j in b.spec.leaf_indices)

    # The products' shapes and dtypes, which every branch (owner or not) must return.
    out_shapes: dict[int, jax.ShapeDtypeStruct] = {}
    for b in blocks:
      res = jax.eval_shape(
        lambda c, v, b=b: fn(
          b, optax.tree_utils.tree_cast(b.init_factors(), b.config.inverse_dtype), c, v
        ),
        b.cache_shapes(),
        [jax.ShapeDtypeStruct(np.shape(leaves[j]), leaves[j].dtype) for j in b.spec.leaf_indices],
      )
      out_shapes.update(zip(b.spec.leaf_indices, res))

    def local(axis, flay, clay, factors, cache, vecs):
      by_leaf = dict(zip(covered, vecs))

      def run(d):
        out = {j: jnp.zeros(out_shapes[j].shape, out_shapes[j].dtype) for j in covered}
        mine = (
          _parallel.unpack(flay, d, factors.buffers),
          _parallel.unpack(clay, d, cache.buffers),
        )
        out.update(_products(blocks, clay.shares[d], *mine, by_leaf, fn))
        return [out[j] for j in covered]

      return jax.lax.psum(_parallel.on_own_share(run, clay.shares, axis), axis)

    args = (factors, cache, [leaves[j] for j in covered])
    res = self._run(blocks, method, axis_name, mesh, local, args, (True, True, False), False)
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
    _check_sharded(factors, "to_dense", "factors")
    bufs = factors.buffers
    lens = {k: int(np.size(v)) for k, v in bufs.items()}

    def fits(d: int) -> bool:
      return {k: n * d for k, n in self.layouts(blocks, d)[0].lengths} == lens

    rows = {int(np.shape(v)[0]) for v in bufs.values() if np.ndim(v) == 2}
    first = min(lens.values())
    candidates = rows or [d for d in range(1, first + 1) if first % d == 0]
    num = next((d for d in candidates if fits(d)), None)
    if num is None:
      raise ValueError(
        "the sharded factors' buffers fit no number of devices: pass the global state (as "
        "`init` returned it under pmap or with `mesh`), not one device's share of it."
      )
    flay = self.layouts(blocks, num)[0]
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

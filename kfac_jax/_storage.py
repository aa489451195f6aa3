"""Where the block state lives on a data-parallel axis (docs/parallel.rst): `ReplicatedStorage`
(every device holds every block) or `ShardedStorage` (KAISA's memory-optimised strategy, the
factors sharded too: device d keeps its share S_d and the update is one exact `psum`,
`u = Σ_d [(F̂_b + λ)⁻¹ g_b for b ∈ S_d, 0 elsewhere]`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfac_jax import _checks, _parallel
from kfac_jax import blocks as _blocks

if TYPE_CHECKING:
  from kfac_jax.blocks import Block

Array = jax.Array
Layouts = tuple[_parallel.PackedLayout, _parallel.PackedLayout]


def all_finite(tree) -> Array:
  """Whether every leaf is finite, through its sum (one cheap fused reduction; errs safe)."""
  leaves = jax.tree_util.tree_leaves(tree)
  flags = [jnp.isfinite(jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32))) for x in leaves]
  return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def _keep_finite(new: dict, old: dict, keys) -> tuple[dict, Array]:
  """Per key, `new[k]` if finite, else `old[k]`; and `[len(keys)]` bool, the keys that failed."""
  kept, failed = {}, []
  for k in keys:
    ok = all_finite(new[k])
    kept[k] = jax.lax.cond(ok, lambda k=k: new[k], lambda k=k: old[k])
    failed.append(~ok)
  return kept, jnp.stack(failed) if failed else jnp.zeros((0,), bool)


def _fold(old, new, weight, average):
  return jax.tree_util.tree_map(lambda o, b: average(o, b, weight), old, new)


def _products(blocks, indices, factors, caches, leaves, fn) -> dict[int, Any]:
  """`{leaf: fn(block, factors, cache, vecs)}` for the blocks `indices`, factors cast."""
  out: dict[int, Any] = {}
  for i in indices:
    b, idx = blocks[i], blocks[i].spec.leaf_indices
    f = optax.tree_utils.tree_cast(factors[i], b.config.inverse_dtype)
    out.update(zip(idx, fn(b, f, caches[i], [leaves[j] for j in idx])))
  return out


@dataclasses.dataclass(frozen=True)
class _Strategy:
  """A storage strategy, bound by `bind` to the estimator's blocks and their names."""

  names: tuple[str, ...] = dataclasses.field(default=(), repr=False)
  blocks: tuple[Block, ...] = dataclasses.field(default=(), repr=False)

  def bind(self, names: Sequence[str], blocks: Sequence[Block]) -> Self:
    """This strategy for `blocks` (named `names`); raises where it cannot keep one of them."""
    return dataclasses.replace(self, names=tuple(names), blocks=tuple(blocks))

  def block_cache(self, cache, name: str):
    """The cache of block `name`, for statistics that need it (no sharded block does)."""
    return cache[name]


@dataclasses.dataclass(frozen=True)
class ReplicatedStorage(_Strategy):
  """Every device keeps every block's state (by name); the refresh may be split over devices."""

  def init_state(self, axis_name, mesh) -> tuple[dict, dict]:
    """`(factors, cache)`: zeros and identities by name, one program (op by op, each compiles)."""
    del axis_name, mesh
    pairs = tuple(zip(self.names, self.blocks))
    return jax.jit(
      lambda: ({n: b.init_factors() for n, b in pairs}, {n: b.init_cache() for n, b in pairs})
    )()

  def fold(self, factors, new, weight, average, axis_name, mesh) -> dict:
    """`average(old, batch, weight)` leaf by leaf, `new` the batch's statistics by name."""
    del axis_name, mesh
    return {n: _fold(factors[n], new[n], weight, average) for n in self.names}

  def refresh(self, factors, cache, damping, axis_name, mesh) -> tuple[dict, Array]:
    """`(new cache, failed)`: `[len(blocks)]` bool, the blocks that kept their old cache."""
    names, blocks = self.names, self.blocks

    def compute(indices, factors, lam):
      return {names[i]: c for i, c in _blocks.compute_caches(blocks, indices, factors, lam).items()}

    def split(axis, factors, lam):  # Each device its share; the others' entries are zeros.
      shares = _parallel.refresh_assignment(
        [b.factor_shapes for b in blocks], jax.lax.axis_size(axis)
      )
      run = lambda d: {**zeros, **compute(shares[d], factors, lam)}
      return jax.lax.psum(_parallel.on_own_share(run, shares, axis), axis)

    zeros = optax.tree_utils.tree_zeros_like(cache)
    by_block = [factors[n] for n in names]
    if axis_name is not None:
      new = split(axis_name, by_block, damping)
    elif mesh is not None:
      new = _parallel.over_mesh(split, mesh, (by_block, damping), (False, False), False)
    else:
      new = compute(range(len(blocks)), by_block, damping)
    return _keep_finite(new, cache, names)

  def apply(self, factors, cache, leaves, fn, axis_name, mesh, method) -> list:
    """`fn(block, factors, cache, vecs)` for every block, into a copy of `leaves`."""
    del axis_name, mesh, method
    f, c = [factors[n] for n in self.names], [cache[n] for n in self.names]
    out = _products(self.blocks, range(len(self.blocks)), f, c, leaves, fn)
    return [out.get(j, x) for j, x in enumerate(leaves)]

  def block_factors(self, factors) -> dict[str, Any]:
    """Every block's factors by name (for `to_dense`)."""
    return factors


def _check_sharded(state, method: str, field: str) -> None:
  if not isinstance(state, _parallel.ShardedCache):
    raise TypeError(
      f"`{method}`: the state's {field} is a {type(state).__name__}, not the ShardedCache that "
      "inverse_storage='sharded' keeps; initialise the state with this estimator's `init`."
    )


@functools.lru_cache(maxsize=64)
def _layouts(blocks: tuple[Block, ...], num_devices: int) -> Layouts:
  shares = _parallel.refresh_assignment(
    [b.factor_shapes for b in blocks], num_devices, [b.state_bytes() for b in blocks]
  )
  return (
    _parallel.packed_layout([jax.eval_shape(b.init_factors) for b in blocks], shares),
    _parallel.packed_layout([b.cache_shapes() for b in blocks], shares),
  )


@dataclasses.dataclass(frozen=True)
class ShardedStorage(_Strategy):
  """Each device keeps, folds, refreshes and applies only its share of the blocks; every call
  needs `axis_name` (inside pmap / shard_map) or `mesh`."""

  def __post_init__(self):
    for n, b in zip(self.names, self.blocks):
      if b.needs_cache_for_statistics:
        raise ValueError(
          f"layer `{n}`: approx={b.spec.approx!r} needs its cache for the statistics, which "
          "inverse_storage='sharded' keeps on one device; use 'replicated' or another approx."
        )

  def layouts(self, num_devices: int) -> Layouts:
    """The blocks' factors and caches laid out on `num_devices` devices (the same shares)."""
    return _layouts(self.blocks, num_devices)

  def _run(self, method, axis_name, mesh, run, args, sharded, out_sharded, finish=None):
    """`run(d, factors layout, cache layout, *args)` on each device d of `axis_name` or of a
    `shard_map` over `mesh` (splitting the `sharded` arguments), then `finish(out, axis)`."""
    if axis_name is not None and mesh is not None:
      raise ValueError(
        f"`{method}`: pass `axis_name` (inside pmap/shard_map) or `mesh` (under jit), not both."
      )
    if axis_name is None and mesh is None:
      raise ValueError(
        f"`{method}`: inverse_storage='sharded' splits the state over devices: pass `axis_name=` "
        "inside pmap/shard_map, or `mesh=(mesh, axis)` under jit."
      )
    if axis_name is None:
      m, axis = _parallel.mesh_axis(mesh)
      size = int(m.shape[axis])
    else:
      try:
        size = jax.lax.axis_size(axis_name)
      except NameError:
        raise ValueError(
          f"`{method}` with inverse_storage='sharded' and axis_name={axis_name!r} must run inside "
          f"pmap/shard_map over {axis_name!r}, e.g. `jax.pmap(tx.init, axis_name={axis_name!r})`."
        ) from None
    lays = self.layouts(size)
    for lay, state, field in zip(lays, args[: sum(sharded)], ("factors", "cache")):
      _check_sharded(state, method, field)
      want = {k: (n * (1 if axis_name is not None else size),) for k, n in lay.lengths}
      got = {k: tuple(np.shape(v)) for k, v in state.buffers.items()}
      if got != want:
        raise ValueError(
          f"`{method}`: the sharded {field} has buffers {got}, but {size} devices need {want} "
          f"({'the global arrays' if axis_name is None else 'each device'}). Was the state "
          "initialised for another number of devices? Initialise it on the axis it is used with."
        )

    def local(axis, *args):
      out = _parallel.on_own_share(lambda d: run(d, *lays, *args), lays[0].shares, axis)
      return out if finish is None else finish(out, axis)

    if axis_name is not None:
      return local(axis_name, *args)
    return _parallel.over_mesh(local, mesh, args, sharded, out_sharded)

  def init_state(self, axis_name, mesh):
    """`(factors, cache)`: each device's buffers of its blocks' zero factors, identity caches."""

    def run(d, flay, clay):
      share = flay.shares[d]
      f = _parallel.pack(flay, d, {i: self.blocks[i].init_factors() for i in share})
      c = _parallel.pack(clay, d, {i: self.blocks[i].init_cache() for i in share})
      return _parallel.ShardedCache(f), _parallel.ShardedCache(c)

    return self._run("init", axis_name, mesh, run, (), (), (True, True))

  def fold(self, factors, new, weight, average, axis_name, mesh):
    """Each device folds its blocks' entries of this batch's statistics `new` (by name)."""

    def run(d, flay, clay, factors, new, weight):
      old = _parallel.unpack(flay, d, factors.buffers)
      folded = {i: _fold(f, new[self.names[i]], weight, average) for i, f in old.items()}
      return _parallel.ShardedCache(_parallel.pack(flay, d, folded))

    args = (factors, new, weight)
    return self._run("update_curvature", axis_name, mesh, run, args, (True, False, False), True)

  def refresh(self, factors, cache, damping, axis_name, mesh):
    """`(new ShardedCache, failed)`: each device refreshes its own blocks."""
    blocks = self.blocks

    def run(d, flay, clay, factors, cache, lam):
      share = clay.shares[d]
      mine = _parallel.unpack(flay, d, factors.buffers)
      new = _blocks.compute_caches(blocks, share, [mine.get(i) for i in range(len(blocks))], lam)
      kept, failed = _keep_finite(new, _parallel.unpack(clay, d, cache.buffers), share)
      at = np.asarray(share, np.int32)
      flags = jnp.zeros((len(blocks),), jnp.int32).at[at].set(failed.astype(jnp.int32))
      return _parallel.ShardedCache(_parallel.pack(clay, d, kept)), flags

    finish = lambda out, axis: (out[0], jax.lax.psum(out[1], axis) > 0)
    args, sharded = (factors, cache, damping), (True, True, False)
    return self._run("update_inverses", axis_name, mesh, run, args, sharded, (True, False), finish)

  def apply(self, factors, cache, leaves, fn, axis_name, mesh, method) -> list:
    """`fn` for each block on its owner, zeros elsewhere, summed; other leaves pass through."""
    blocks = self.blocks
    covered = sorted(j for b in blocks for j in b.spec.leaf_indices)
    # The products' shapes and dtypes, which every branch (owner or not) must return.
    shapes = jax.eval_shape(
      lambda f, c, v: _products(blocks, range(len(blocks)), f, c, v, fn),
      [jax.eval_shape(b.init_factors) for b in blocks],
      [b.cache_shapes() for b in blocks],
      [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves],
    )

    def run(d, flay, clay, factors, cache, vecs):
      out = {j: jnp.zeros(shapes[j].shape, shapes[j].dtype) for j in covered}
      f, c = (_parallel.unpack(lay, d, s.buffers) for lay, s in ((flay, factors), (clay, cache)))
      out.update(_products(blocks, clay.shares[d], f, c, dict(zip(covered, vecs)), fn))
      return [out[j] for j in covered]

    args = (factors, cache, [leaves[j] for j in covered])
    res = self._run(method, axis_name, mesh, run, args, (True, True, False), False, jax.lax.psum)
    got = dict(zip(covered, res))
    return [got.get(j, x) for j, x in enumerate(leaves)]

  def block_factors(self, factors) -> dict[str, Any]:
    """Every block's factors by name, from the global buffers (`[D, L]` or `[D·L]`)."""
    _check_sharded(factors, "to_dense", "factors")
    bufs = factors.buffers
    lens = {k: int(np.size(v)) for k, v in bufs.items()}
    rows = {int(np.shape(v)[0]) for v in bufs.values() if np.ndim(v) == 2}
    first = min(lens.values())
    candidates = rows or [d for d in range(1, first + 1) if first % d == 0]
    fits = (d for d in candidates if {k: n * d for k, n in self.layouts(d)[0].lengths} == lens)
    num = next(fits, None)
    if num is None:
      raise ValueError(
        "the sharded factors' buffers fit no number of devices: pass the global state (as "
        "`init` returned it under pmap or with `mesh`), not one device's share of it."
      )
    out: dict[str, Any] = {}
    for d in range(num):
      local = {k: jnp.reshape(v, (num, -1))[d] for k, v in bufs.items()}
      unpacked = _parallel.unpack(self.layouts(num)[0], d, local)
      out.update((self.names[i], f) for i, f in unpacked.items())
    return out


Storage = ReplicatedStorage | ShardedStorage
_BY_NAME: dict[str, Storage] = {"replicated": ReplicatedStorage(), "sharded": ShardedStorage()}


def strategy(value, name: str = "inverse_storage") -> Storage:
  """The storage object for `value`: a `ReplicatedStorage` / `ShardedStorage`, or its name."""
  if isinstance(value, (ReplicatedStorage, ShardedStorage)):
    return value
  _checks.choice(value, name, tuple(_BY_NAME))
  return _BY_NAME[value]

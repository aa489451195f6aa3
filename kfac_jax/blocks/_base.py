"""The curvature-block interface.

A block is a static object (its layer spec and configuration); its numbers live in two typed
pytrees (one `NamedTuple` per block kind, defined next to the block) that the estimator keeps in
its state, keyed by block name:

  factors  the EMA statistics (e.g. `KroneckerFactors(a=A, g=G)`), undamped;
  cache    what `update_inverses` derives from the factors and the damping λ: matrix powers,
           eigen-decompositions, Cholesky factors, and `damping`, the λ they were built with
           (every cache type has that field).

Entries a configuration does not need (a Cholesky factor without `cholesky=True`, powers in
"eigen" damping mode) are None, so the pytree holds only what is computed. A block also states
its own factor shapes: `factor_shapes_for(spec)`, a class method, answers them from the layer's
kind, approximation and matching details before any block exists (the scanner sizes each
`LayerSpec` and applies its size policy with it), and `factor_shapes` gives them for the block's
own spec. The estimator and the parallel code read them from the block, never from arithmetic on
the layer's dimensions.

Vectors are the block's parameter leaves (parameter-shaped arrays), in `spec.leaf_indices` order.
"Damped block" means the matrix the block actually multiplies by: `A_λ ⊗ G_λ` with π-adjusted
factored Tikhonov damping for Kronecker blocks in "factored" mode, and `F + λ I` otherwise.
Concrete blocks are final: they implement this interface and are never subclassed.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import jax
import jax.numpy as jnp

from kfac_jax._specs import LayerSpec

if TYPE_CHECKING:
  from kfac_jax._specs import Approximation, Kind

Array = jax.Array
DampingMode = Literal["factored", "eigen"]
FactorSolve = Literal["auto", "always", "never"]


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Static options shared by all blocks of one estimator.

  Attributes:
    exps: matrix powers the cache is prepared for (1 is always available).
    damping_mode: "factored" (π-adjusted factored Tikhonov damping, the K-FAC default) or
      "eigen" (exact `A ⊗ G + λ I` through eigen-decompositions of the factors).
    cholesky: also cache Cholesky factors (for `multiply_cholesky`).
    cholesky_inverse: also cache inverse Cholesky factors.
    stats_dtype: dtype in which batch statistics are computed and the factors (their moving
      averages) are stored: float32 by default, float64 under x64, or bfloat16 / float16 to
      halve the factors' memory.
    inverse_dtype: dtype of everything `update_inverses` derives (powers, eigen-decompositions,
      Cholesky factors, the damping) and of the products: float32 or float64. Factors are cast
      to it before they are factorised.
    preconditioner_dtype: None (`inverse_dtype`), or a narrower dtype (bfloat16) the cached
      matrix powers of Kronecker factors and full blocks are stored in once computed (in
      `inverse_dtype`); the products with them round the vector to it and accumulate in
      `inverse_dtype` (`_linalg.matmul`). Diagonal factors, substitution forms,
      eigen-decompositions, the series blocks' caches and Cholesky factors stay in
      `inverse_dtype`.
    factor_solve: how a Kronecker factor's damped inverse (power -1, "factored" damping) is kept.
      "never": as an explicit matrix, products are matmuls. "always": in substitution form (its
      Cholesky factor in blocks, `_linalg.substitution_form`), products are block substitutions (a
      refresh ~3x faster, products a few times slower). "auto" (default): the substitution form for
      a factor of size n ≥ 256 multiplied by at most n/8 columns (a wide input into a narrow layer,
      e.g. a classifier head), where the cheaper refresh outweighs slower products; see
      `KroneckerBlock.solves`. Stacks of layers and grouped convolutions (vmapped blocks) always
      keep explicit inverses.
  """

  exps: tuple[float, ...] = (-1.0,)
  damping_mode: DampingMode = "factored"
  cholesky: bool = False
  cholesky_inverse: bool = False
  stats_dtype: Any = jnp.float32
  inverse_dtype: Any = jnp.float32
  factor_solve: FactorSolve = "auto"
  preconditioner_dtype: Any = None

  def stored_power(self, p: Array) -> Array:
    """A cached matrix power as kept in the cache: cast to `preconditioner_dtype` (if set); a
    diagonal factor's vector of powers stays in `inverse_dtype`."""
    dtype = self.preconditioner_dtype
    return p if dtype is None or p.ndim < 2 or p.dtype == dtype else p.astype(dtype)

  @property
  def cached_exps(self) -> tuple[float, ...]:
    """The powers a cache holds, in order (`exps` without 1, which needs no cache)."""
    return tuple(e for e in self.exps if e != 1)

  def power_index(self, exp: float) -> int:
    """The position of power `exp` in `cached_exps` (and in a cache's `powers`)."""
    return self.cached_exps.index(exp)

  @property
  def accum_dtype(self):
    """The dtype batch statistics are accumulated in: `stats_dtype`, at least float32."""
    return jnp.promote_types(self.stats_dtype, jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedUses:
  """The T taps of one layer inside one scan, stacked along the steps (execution order).

  Attributes:
    inputs: the recorded input operands, each `[T, ...]`.
    g: the output gradients, `[samples, T, ...]`.
  """

  inputs: tuple[Any, ...]
  g: Any

  def unstack(self) -> tuple[tuple[tuple[Any, ...], Any], ...]:
    """The per-use `(inputs, g)` pairs (one slice per step)."""
    steps = self.g.shape[1]
    return tuple((tuple(x[t] for x in self.inputs), self.g[:, t]) for t in range(steps))


class Block(abc.ABC):
  """Abstract curvature block: statistics, damped powers, Cholesky products, dense matrix.

  Attributes:
    needs_cache_for_statistics: the statistics depend on the cache (EKFAC's scalings live in
      the eigenbasis of the last inverse update): `batch_factors` and `multiply_undamped` then
      take the block's cache.
  """

  # The (layer kind, approximation) pairs this block class computes; the block registry
  # (`blocks.block_class`) is built from these declarations. Wrappers (concatenated leaves,
  # stacks) serve none: they hold the block of the layer they wrap.
  serves: ClassVar[frozenset[tuple[Kind, Approximation]]] = frozenset()
  needs_cache_for_statistics: bool = False
  # Set by a wrapper that vmaps this block over a leading axis (`StackedBlock`).
  vmapped: bool = False

  def __init__(self, spec: LayerSpec, config: BlockConfig):
    self.spec = spec
    self.config = config

  @property
  def name(self) -> str:
    return self.spec.name

  @classmethod
  @abc.abstractmethod
  def factor_shapes_for(cls, spec: LayerSpec) -> tuple[tuple[int, ...], ...]:
    """The shapes of the matrix (or vector) factors this block class keeps for the layer `spec`,
    e.g. `((in+1, in+1), (out, out))`, from its kind, approximation, matching details (`info`)
    and leaves; `spec.factor_shapes` is not read (the scanner asks while building the spec)."""

  @property
  def factor_shapes(self) -> tuple[tuple[int, ...], ...]:
    """`factor_shapes_for(self.spec)`: they size the state, the parallel work split and the
    layer table."""
    return self.factor_shapes_for(self.spec)

  def group_key(self) -> tuple:
    """Blocks with equal keys have identically shaped state and are batched with vmap."""
    return (type(self).__name__, self.factor_shapes, self.spec.approx)

  def accepts_stacked_uses(self) -> bool:
    """Whether `batch_factors` takes a `StackedUses` (else it gets the unstacked uses)."""
    return False

  # -- statistics ------------------------------------------------------------------------------

  @abc.abstractmethod
  def init_factors(self) -> Any:
    """Zero statistics (the block kind's factors type)."""

  @abc.abstractmethod
  def batch_factors(self, data: Any, batch_size: int, cache: Any = None) -> Any:
    """This batch's statistics from the curvature pass's raw data for the block.

    `cache` is the block's current cache for blocks with `needs_cache_for_statistics` (None
    before the estimator has one), and ignored by the others."""

  # -- inverses --------------------------------------------------------------------------------

  @abc.abstractmethod
  def init_cache(self) -> Any:
    """A cache that makes every power act as the identity (before the first inverse update)."""

  @abc.abstractmethod
  def compute_cache(self, factors: Any, damping: Array) -> Any:
    """Powers / decompositions of the damped block. Pure; vmapped over blocks of a group."""

  # -- products --------------------------------------------------------------------------------

  @abc.abstractmethod
  def multiply_matpower(self, factors, cache, vecs: Sequence[Array], exp: float) -> list[Array]:
    """(damped block)^exp · vecs; `exp` is 1 or one of `config.exps`."""

  @abc.abstractmethod
  def multiply_cholesky(
    self, factors, cache, vecs: Sequence[Array], *, transpose: bool, inverse: bool
  ) -> list[Array]:
    """C·v, Cᵀ·v, C⁻¹·v or C⁻ᵀ·v for a factor C with C Cᵀ = damped block."""

  @abc.abstractmethod
  def multiply_undamped(self, factors, vecs: Sequence[Array], cache: Any = None) -> list[Array]:
    """The undamped estimate times vecs (used by `to_dense`); `cache` as in `batch_factors`."""

  # -- helpers ---------------------------------------------------------------------------------

  def to_dense(self, factors, cache: Any = None) -> Array:
    """The undamped block as a `[n, n]` matrix over its leaves, raveled and concatenated
    (`cache` as in `batch_factors`)."""
    sizes = [math.prod(s) for s in self.spec.param_shapes]
    n = sum(sizes)

    def column(e):
      vecs, off = [], 0
      for size, shape in zip(sizes, self.spec.param_shapes):
        vecs.append(e[off : off + size].reshape(shape))
        off += size
      out = self.multiply_undamped(factors, vecs, cache)
      return jnp.concatenate([v.ravel() for v in out])

    factors = jax.tree_util.tree_map(lambda x: x.astype(self.config.inverse_dtype), factors)
    return jax.vmap(column, out_axes=1)(jnp.eye(n, dtype=self.config.inverse_dtype))

  def cache_shapes(self) -> Any:
    """The cache's structure with `jax.ShapeDtypeStruct` leaves (nothing is computed)."""
    return jax.eval_shape(self.init_cache)

  def state_bytes(self) -> int:
    shapes = jax.eval_shape(lambda: (self.init_factors(), self.init_cache()))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))

  def check_exp(self, exp: float) -> None:
    if exp != 1 and exp not in self.config.exps:
      raise ValueError(
        f"matrix power {exp} was not prepared: the estimator was built with exps="
        f"{self.config.exps} (1 is always available). Add {exp} to `exps`."
      )


def batched_factorisations() -> bool:
  """Whether equal-shape blocks share one vmapped (batched) factorisation: not on CPU.

  jaxlib's batched CPU LAPACK kernels split their batch over the same small thread pool that
  runs them, and two running at once (the A and G factors of one group) deadlocked a 2-core
  machine (gdb: both threads in `ParallelBatchMap`, waiting on an `absl::BlockingCounter`; the
  Transformer LM benchmark's first inverse update). One unbatched call per block does not.
  """
  return jax.default_backend() != "cpu"


def _cast(tree, dtype):
  return jax.tree_util.tree_map(lambda x: x if x.dtype == dtype else x.astype(dtype), tree)


def compute_caches(
  blocks: Sequence[Block], indices: Sequence[int], factors: Sequence[Any], damping: Array
) -> dict[int, Any]:
  """`{i: blocks[i].compute_cache(factors[i], damping)}` for the blocks `indices`.

  `factors` has one entry per block, in block order (only those of `indices` are read); each is
  cast to its block's `inverse_dtype` first. Blocks with equal `group_key` (identically shaped
  state) share one vmapped call where `batched_factorisations()`, and get one call each on CPU.
  """
  groups: dict[tuple, list[int]] = {}
  for i in indices:
    groups.setdefault(blocks[i].group_key(), []).append(i)
  out = {}
  for idx in groups.values():
    block = blocks[idx[0]]
    cast = [_cast(factors[i], block.config.inverse_dtype) for i in idx]
    if len(idx) == 1 or not batched_factorisations():
      for i, f in zip(idx, cast):
        out[i] = block.compute_cache(f, damping)
      continue
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *cast)
    res = jax.vmap(block.compute_cache, in_axes=(0, None))(stacked, damping)
    for k, i in enumerate(idx):
      out[i] = jax.tree_util.tree_map(lambda x, k=k: x[k], res)
  return out

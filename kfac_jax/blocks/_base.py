"""The curvature-block interface.

A block is a static object (its layer spec and configuration); its numbers live in two typed
pytrees (`_state`) that the estimator keeps per block name: `factors`, the undamped EMA
statistics, and `cache`, what `update_inverses` derives from them and the damping λ. A block
states its factor shapes before it exists (`factor_shapes_for(spec)`, for the scanner). Vectors
are the block's parameter leaves, in `spec.leaf_indices` order; "damped block" is the matrix the
block multiplies by (`A_λ ⊗ G_λ` in "factored" mode, `F + λ I` otherwise). Concrete blocks are
final.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfac_jax._specs import LayerSpec
from kfac_jax.blocks import _layouts

if TYPE_CHECKING:
  from kfac_jax._specs import Approximation, Kind

Array = jax.Array
DampingMode = Literal["factored", "factored_equal", "eigen"]
FactorSolve = Literal["auto", "always", "never"]
_DTYPES = {
  "stats_dtype": ("bfloat16", "float16", "float32", "float64"),
  "inverse_dtype": ("float32", "float64"),
  "preconditioner_dtype": ("bfloat16", "float32", "float64"),
}


def _dtype(value, field: str) -> Any:
  """The dtype given as `config.<field>` as a numpy dtype: None → float32 (float64 under x64)."""
  x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # A flag added at run time.
  if value is None:
    return np.dtype(np.float64 if x64 else np.float32)
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or dtype.name not in _DTYPES[field]:
    raise ValueError(
      f"`config.{field}` must be one of {', '.join(_DTYPES[field])} (or None for the default), "
      f"got {value!r}."
    )
  if dtype == np.float64 and not x64:
    raise ValueError(
      f"`config.{field}`=float64 needs 64-bit JAX: set "
      "`jax.config.update('jax_enable_x64', True)` before creating arrays, or use float32."
    )
  return dtype


def _choice(value, name: str, choices: tuple[str, ...]) -> None:
  if not isinstance(value, str) or value not in choices:
    raise (ValueError if isinstance(value, str) else TypeError)(
      f"unknown {name} {value!r}; choose one of {', '.join(repr(c) for c in choices)}."
    )


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Static options shared by all blocks of one estimator.

  Attributes:
    exps: matrix powers the cache is prepared for (1 is always available).
    damping_mode: "factored" (π-adjusted factored Tikhonov damping, the K-FAC default: π√λ
      on a layer's input factor and √λ/π on its output factor, π from their traces, Martens &
      Grosse 2015), "factored_equal" (√λ on each, as the K-FAC for PINNs code does; then the
      factors' relative scale matters) or "eigen" (exact `A ⊗ G + λ I` through
      eigen-decompositions of the factors).
    cholesky: also cache Cholesky factors (for `multiply_cholesky`).
    cholesky_inverse: also cache inverse Cholesky factors.
    stats_dtype: dtype in which batch statistics are computed and the factors (their moving
      averages) are stored: float32 by default, float64 under x64, or bfloat16 / float16 to
      halve the factors' memory.
    inverse_dtype: dtype of everything `update_inverses` derives (powers, eigen-decompositions,
      Cholesky factors, the damping) and of the products: float32 or float64. Factors are cast
      to it before they are factorised.
    preconditioner_dtype: None (`inverse_dtype`), or a narrower dtype (bfloat16) the cached
      matrix powers of Kronecker factors and full blocks are stored in once computed; products
      round the vector to it and accumulate in `inverse_dtype` (`_linalg.matmul`). Everything
      else in the cache stays in `inverse_dtype`.
    factor_solve: how a Kronecker factor's damped inverse ("factored" damping) is kept. "never":
      an explicit matrix (products are matmuls). "always": its substitution form
      (`_linalg.substitution_form`; a cheaper refresh, slower products). "auto" (default): the
      substitution form for a factor of size n ≥ 256 multiplied by at most n/8 columns (e.g. a
      classifier head); see `KroneckerBlock.solves`. Vmapped blocks (stacks, grouped
      convolutions) always keep explicit inverses.
  """

  exps: tuple[float, ...] = (-1.0,)
  damping_mode: DampingMode = "factored"
  cholesky: bool = False
  cholesky_inverse: bool = False
  stats_dtype: Any = jnp.float32
  inverse_dtype: Any = jnp.float32
  factor_solve: FactorSolve = "auto"
  preconditioner_dtype: Any = None

  @classmethod
  def of(
    cls,
    *,
    damping_mode="factored",
    factor_solve="auto",
    stats_dtype=None,
    inverse_dtype=None,
    preconditioner_dtype=None,
    exps=(-1.0,),
    cholesky=False,
    cholesky_inverse=False,
  ) -> BlockConfig:
    """The numerics from their user spellings (`kfac_jax.Config`'s fields), checked: the modes
    among their choices, the dtypes as names or dtypes (None: float32, float64 under x64), a
    `preconditioner_dtype` no wider than `inverse_dtype` (None where equal)."""
    _choice(damping_mode, "config.damping_mode", ("factored", "factored_equal", "eigen"))
    _choice(factor_solve, "config.factor_solve", ("auto", "always", "never"))
    inverse = _dtype(inverse_dtype, "inverse_dtype")
    narrow = (
      None if preconditioner_dtype is None else _dtype(preconditioner_dtype, "preconditioner_dtype")
    )
    if narrow is not None and narrow.itemsize > inverse.itemsize:
      raise ValueError(
        f"`config.preconditioner_dtype`={narrow.name} is wider than `inverse_dtype`="
        f"{inverse.name}: the inverses are computed in `inverse_dtype` and can only be "
        "stored narrower (e.g. bfloat16)."
      )
    return cls(
      exps=tuple(exps),
      damping_mode=damping_mode,
      cholesky=cholesky,
      cholesky_inverse=cholesky_inverse,
      stats_dtype=_dtype(stats_dtype, "stats_dtype"),
      inverse_dtype=inverse,
      factor_solve=factor_solve,
      preconditioner_dtype=None if narrow == inverse else narrow,
    )

  @property
  def factored(self) -> bool:
    """Whether the damping is factored over the Kronecker factors (not "eigen")."""
    return self.damping_mode != "eigen"

  @property
  def split(self) -> Literal["pi", "equal"]:
    """How factored damping shares √λ between two factors: "pi" (π-adjusted) or "equal"."""
    return "equal" if self.damping_mode == "factored_equal" else "pi"

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

  A user's block for a layer (`LayerConfig.blocks`) subclasses this and implements six methods:
  `factor_shapes_for` (a classmethod, asked before the block exists), `init_factors` and
  `batch_factors` (the statistics: pytrees of arrays, which the estimator averages leafwise
  with its EMA), `init_cache` and `compute_cache` (what the refresh derives from the averaged
  statistics and the damping λ; `init_cache` acts as the identity) and `multiply_matpower`
  (the damped block's power times the layer's leaves). `multiply_cholesky` and
  `multiply_undamped` (`to_dense`) are optional. `gradient_rows` gives the rows every exact
  block is built from; `to_vector` / `from_vector` flatten the leaves in the same order.
  The block is built as `cls(spec, config)`: `spec` the layer's `LayerSpec`, `config` the
  estimator's `BlockConfig` (dtypes, `exps`); factors are kept in `config.stats_dtype`, caches
  and products in `config.inverse_dtype`. Every method is traced (jit, vmap over a stack of
  layers), so it is pure and reads only static facts from `spec`.

  Attributes:
    serves: the (layer kind, approximation) pairs this class computes (`blocks.block_class`);
      wrappers serve none.
    needs_cache_for_statistics: the statistics depend on the cache (EKFAC's eigenbasis):
      `batch_factors` and `multiply_undamped` then take the block's cache.
    vmapped: set by a wrapper that vmaps this block over a leading axis (`StackedBlock`).
  """

  serves: ClassVar[frozenset[tuple[Kind, Approximation]]] = frozenset()
  needs_cache_for_statistics: bool = False
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
    """The shapes of the factors this class keeps for the layer `spec`, e.g. `((in+1, in+1),
    (out, out))`; `spec.factor_shapes` is not read (the scanner asks while building it)."""

  @property
  def factor_shapes(self) -> tuple[tuple[int, ...], ...]:
    """`factor_shapes_for(self.spec)`."""
    return self.factor_shapes_for(self.spec)

  def group_key(self) -> tuple:
    """Blocks with equal keys have identically shaped state and are batched with vmap: one
    `compute_cache` call, the group's first block's, over their stacked factors. The default,
    (class, factor shapes, approximation), fits a `compute_cache` that reads nothing else of
    `spec`; a user's block whose refresh does overrides this."""
    return (type(self), self.factor_shapes, self.spec.approx)

  def accepts_stacked_uses(self) -> bool:
    """Whether `batch_factors` takes a `StackedUses` (else it gets the unstacked uses)."""
    return False

  # -- statistics ------------------------------------------------------------------------------

  @abc.abstractmethod
  def init_factors(self) -> Any:
    """Zero statistics (the block kind's factors type)."""

  @abc.abstractmethod
  def batch_factors(self, data: Any, batch_size: int, cache: Any = None) -> Any:
    """This batch's statistics from the curvature pass's raw data for the block; `cache`: the
    block's cache where `needs_cache_for_statistics` (None before there is one)."""

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

  def multiply_cholesky(
    self, factors, cache, vecs: Sequence[Array], *, transpose: bool, inverse: bool
  ) -> list[Array]:
    """C·v, Cᵀ·v, C⁻¹·v or C⁻ᵀ·v for a factor C with C Cᵀ = damped block (the estimator's
    `multiply_cholesky`; optional for a user's block)."""
    del factors, cache, vecs, transpose, inverse
    raise NotImplementedError(
      f"block `{self.name}` ({type(self).__name__}) does not implement multiply_cholesky."
    )

  def multiply_undamped(self, factors, vecs: Sequence[Array], cache: Any = None) -> list[Array]:
    """The undamped estimate times vecs (used by `to_dense`); `cache` as in `batch_factors`
    (optional for a user's block)."""
    del factors, vecs, cache
    raise NotImplementedError(
      f"block `{self.name}` ({type(self).__name__}) does not implement multiply_undamped, "
      "which `to_dense` needs."
    )

  def to_vector(self, vecs: Sequence[Array]) -> Array:
    """The layer's leaves `vecs` as one vector `[n]` in `config.inverse_dtype` (raveled and
    concatenated in `spec.param_paths` order, the order of `gradient_rows`' columns)."""
    return flat(vecs, self.config.inverse_dtype)

  def from_vector(self, x: Array, vecs: Sequence[Array]) -> list[Array]:
    """`to_vector`'s inverse: `x: [n]` as leaves shaped and typed like `vecs`."""
    return unflat(x, vecs)

  def gradient_rows(self, data: Any, batch_size: int) -> tuple[Array, int]:
    """`(h, c)`: rows `h: [R, n]` of gradients over the block's parameters (its leaves raveled
    and concatenated in `spec.param_paths` order) with `hᵀh / c` the layer's exact Fisher
    block for this batch's vectors (`kfac_jax._curvature`); `data` and `batch_size` as
    `batch_factors` receives them. Dense, convolution and scale-and-shift layers: one row per
    example and sample, rebuilt from the recorded inputs and output gradients; generic
    parameters: each sample's batch-summed gradient, unbiased for sampled targets. The "full"
    and "diagonal" blocks are `hᵀh / c` and its diagonal."""
    return _layouts.gradient_rows(self.spec, data, batch_size, self.config.accum_dtype)

  # -- helpers ---------------------------------------------------------------------------------

  def to_dense(self, factors, cache: Any = None) -> Array:
    """The undamped block as a `[n, n]` matrix over its leaves, raveled and concatenated
    (`cache` as in `batch_factors`)."""
    dtype = self.config.inverse_dtype
    like = [jax.ShapeDtypeStruct(s, dtype) for s in self.spec.param_shapes]
    factors = optax.tree_utils.tree_cast(factors, dtype)

    def column(e):
      return flat(self.multiply_undamped(factors, unflat(e, like), cache), dtype)

    n = sum(math.prod(s) for s in self.spec.param_shapes)
    return jax.vmap(column, out_axes=1)(jnp.eye(n, dtype=dtype))

  def cholesky_factor(self, c, inverse: bool):
    """`c`, a cached Cholesky factor (inverse), or an error naming the option it needs."""
    if c is None:
      raise ValueError(
        f"block `{self.name}`: Cholesky{' inverse' if inverse else ''} products need "
        f"compute_cholesky{'_inverse' if inverse else ''}=True in the estimator."
      )
    return c

  def cache_shapes(self) -> Any:
    """The cache's structure with `jax.ShapeDtypeStruct` leaves (nothing is computed)."""
    return jax.eval_shape(self.init_cache)

  def state_bytes(self) -> int:
    shapes = jax.eval_shape(lambda: (self.init_factors(), self.init_cache()))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))


def batched_factorisations() -> bool:
  """Whether equal-shape blocks share one vmapped (batched) factorisation: not on CPU, where
  two batched LAPACK kernels running at once can deadlock the small thread pool they share."""
  return jax.default_backend() != "cpu"


def flat(vecs: Sequence[Array], dtype) -> Array:
  """The leaves raveled and concatenated, in `dtype`."""
  return jnp.concatenate([jnp.ravel(v).astype(dtype) for v in vecs])


def unflat(x: Array, like: Sequence[Any]) -> list[Array]:
  """`flat`'s inverse: leaves with the shapes and dtypes of `like`."""
  out, off = [], 0
  for v in like:
    size = math.prod(v.shape)
    out.append(x[off : off + size].reshape(v.shape).astype(v.dtype))
    off += size
  return out


def map_factorisations(fn, *args):
  """`fn` over the leading axis of `args`, results stacked: one batched call where
  `batched_factorisations()`, else one unbatched call per slice (`lax.map`)."""
  if batched_factorisations():
    return jax.vmap(fn)(*args)
  return jax.lax.map(lambda a: fn(*a), args)


def compute_caches(
  blocks: Sequence[Block], indices: Sequence[int], factors: Sequence[Any], damping: Array
) -> dict[int, Any]:
  """`{i: blocks[i].compute_cache(factors[i], damping)}` for the blocks `indices` (`factors`
  in block order, cast to `inverse_dtype`); blocks of equal `group_key` share one vmapped call
  where `batched_factorisations()`."""
  groups: dict[tuple, list[int]] = {}
  for i in indices:
    groups.setdefault(blocks[i].group_key(), []).append(i)
  out = {}
  for idx in groups.values():
    block = blocks[idx[0]]
    cast = [optax.tree_utils.tree_cast(factors[i], block.config.inverse_dtype) for i in idx]
    if len(idx) == 1 or not batched_factorisations():
      for i, f in zip(idx, cast):
        out[i] = block.compute_cache(f, damping)
      continue
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *cast)
    res = jax.vmap(block.compute_cache, in_axes=(0, None))(stacked, damping)
    for k, i in enumerate(idx):
      out[i] = jax.tree_util.tree_map(lambda x, k=k: x[k], res)
  return out

"""The curvature-block interface: a static object (its layer spec and configuration) whose
numbers live in two typed pytrees (`_state`), the undamped EMA statistics (`factors`) and what
the refresh derives from them and the damping λ (`cache`). The "damped block" is the matrix a
block multiplies by (`A_λ ⊗ G_λ` in "factored" mode, `F + λ I` otherwise)."""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfac_jax import _checks
from kfac_jax._specs import Approximation, Kind, LayerSpec
from kfac_jax.blocks import _layouts

Array = jax.Array
DampingMode = Literal["factored", "factored_equal", "eigen"]
FactorSolve = Literal["auto", "always", "never"]
_DTYPES = {
  "stats_dtype": ("bfloat16", "float16", "float32", "float64"),
  "inverse_dtype": ("float32", "float64"),
  "preconditioner_dtype": ("bfloat16", "float32", "float64"),
}


def _dtype(value, field: str) -> Any:
  """`config.<field>` as a numpy dtype: None → float32 (float64 under x64)."""
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


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Static options shared by all blocks of one estimator (`kfac_jax.Config`'s numerics).

  Attributes:
    exps: matrix powers the cache is prepared for (1 is always available).
    damping_mode: "factored" (π√λ on a layer's input factor and √λ/π on its output factor, π
      from their traces, Martens & Grosse 2015), "factored_equal" (√λ on each) or "eigen"
      (exact `A ⊗ G + λ I` through the factors' eigen-decompositions).
    cholesky, cholesky_inverse: also cache Cholesky factors, their inverses.
    stats_dtype: dtype of batch statistics and of the stored factors.
    inverse_dtype: dtype of everything the refresh derives and of the products.
    preconditioner_dtype: None, or a narrower dtype the cached matrix powers are stored in;
      products round the vector to it and accumulate in `inverse_dtype` (`_linalg.matmul`).
    factor_solve: how a Kronecker factor's damped inverse is kept: "never" an explicit matrix,
      "always" its substitution form, "auto" where `KroneckerBlock.solves` says so.
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
    cls, *, exps=(-1.0,), stats_dtype=None, inverse_dtype=None, preconditioner_dtype=None, **rest
  ) -> BlockConfig:
    """The numerics from `kfac_jax.Config`'s spellings, checked: dtypes as names or dtypes
    (None: float32, float64 under x64), a `preconditioner_dtype` no wider than `inverse_dtype`
    (None where equal); `rest`: the other fields."""
    config = cls(exps=tuple(exps), **rest)
    _checks.choice(config.damping_mode, "config.damping_mode", get_args(DampingMode))
    _checks.choice(config.factor_solve, "config.factor_solve", get_args(FactorSolve))
    inverse = _dtype(inverse_dtype, "inverse_dtype")
    narrow = (
      None if preconditioner_dtype is None else _dtype(preconditioner_dtype, "preconditioner_dtype")
    )
    if narrow is not None and narrow.itemsize > inverse.itemsize:
      raise ValueError(
        f"`config.preconditioner_dtype`={narrow.name} is wider than `inverse_dtype`="
        f"{inverse.name}, in which the inverses are computed; choose a narrower one (bfloat16)."
      )
    return dataclasses.replace(
      config,
      stats_dtype=_dtype(stats_dtype, "stats_dtype"),
      inverse_dtype=inverse,
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
    """A cached matrix power in `preconditioner_dtype` (if set); vectors stay as they are."""
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
  """The T taps of one layer inside one scan, stacked along the steps (execution order)."""

  inputs: tuple[Any, ...]  # The recorded input operands, each `[T, ...]`.
  g: Any  # The output gradients, `[samples, T, ...]`.

  def unstack(self) -> tuple[tuple[tuple[Any, ...], Any], ...]:
    """The per-use `(inputs, g)` pairs (one slice per step)."""
    return tuple((tuple(x[t] for x in self.inputs), self.g[:, t]) for t in range(self.g.shape[1]))


class Block(abc.ABC):
  """Abstract curvature block: statistics, damped powers, Cholesky products, dense matrix.

  A user's block for a layer (`LayerConfig.blocks`, docs/layers.rst) is built as
  `cls(spec, config)`; vectors are the layer's leaves in `spec.leaf_indices` order. Every method
  is traced (jit, vmap over a stack of layers), so it is pure and reads only static facts from
  `spec`.

  Attributes:
    serves: the (layer kind, approximation) pairs this class computes (`blocks.block_class`).
    needs_cache_for_statistics: `batch_factors` and `multiply_undamped` take the block's cache
      (EKFAC's eigenbasis).
    vmapped: set by a wrapper that vmaps this block over a leading axis (`StackedBlock`).
  """

  serves: ClassVar[frozenset[tuple[Kind, Approximation]]] = frozenset()
  needs_cache_for_statistics: bool = False
  vmapped: bool = False

  def __init__(self, spec: LayerSpec, config: BlockConfig):
    self.spec, self.config = spec, config

  @property
  def name(self) -> str:
    return self.spec.name

  @classmethod
  @abc.abstractmethod
  def factor_shapes_for(cls, spec: LayerSpec) -> tuple[tuple[int, ...], ...]:
    """The factor shapes this class keeps for the layer `spec`, e.g. `((in+1, in+1), (out,
    out))` (the scanner asks while building `spec.factor_shapes`)."""

  @property
  def factor_shapes(self) -> tuple[tuple[int, ...], ...]:
    """`factor_shapes_for(self.spec)`."""
    return self.factor_shapes_for(self.spec)

  def group_key(self) -> tuple:
    """Blocks of equal keys share one vmapped `compute_cache`; override it if yours reads `spec`."""
    return (type(self), self.factor_shapes, self.spec.approx)

  def accepts_stacked_uses(self) -> bool:
    """Whether `batch_factors` takes a `StackedUses` (else it gets the unstacked uses)."""
    return False

  @abc.abstractmethod
  def init_factors(self) -> Any:
    """Zero statistics (the block kind's factors type)."""

  @abc.abstractmethod
  def batch_factors(self, data: Any, batch_size: int, cache: Any = None) -> Any:
    """This batch's statistics; `cache`: where `needs_cache_for_statistics` (None at first)."""

  @abc.abstractmethod
  def init_cache(self) -> Any:
    """A cache that makes every power act as the identity (before the first inverse update)."""

  @abc.abstractmethod
  def compute_cache(self, factors: Any, damping: Array) -> Any:
    """Powers / decompositions of the damped block. Pure; vmapped over blocks of a group."""

  @abc.abstractmethod
  def multiply_matpower(self, factors, cache, vecs: Sequence[Array], exp: float) -> list[Array]:
    """(damped block)^exp · vecs; `exp` is 1 or one of `config.exps`."""

  def multiply_cholesky(
    self, factors, cache, vecs: Sequence[Array], *, transpose: bool, inverse: bool
  ) -> list[Array]:
    """C·v, Cᵀ·v, C⁻¹·v or C⁻ᵀ·v for a factor C with C Cᵀ = damped block (optional)."""
    del factors, cache, vecs, transpose, inverse
    raise NotImplementedError(
      f"block `{self.name}` ({type(self).__name__}) does not implement multiply_cholesky."
    )

  def multiply_undamped(self, factors, vecs: Sequence[Array], cache: Any = None) -> list[Array]:
    """The undamped estimate times vecs (for `to_dense`; optional)."""
    del factors, vecs, cache
    raise NotImplementedError(
      f"block `{self.name}` ({type(self).__name__}) lacks multiply_undamped, which to_dense needs."
    )

  def to_vector(self, vecs: Sequence[Array]) -> Array:
    """The leaves raveled and concatenated, `[n]` in `inverse_dtype` (`gradient_rows`' order)."""
    return flat(vecs, self.config.inverse_dtype)

  def from_vector(self, x: Array, vecs: Sequence[Array]) -> list[Array]:
    """`to_vector`'s inverse: `x: [n]` as leaves shaped and typed like `vecs`."""
    return unflat(x, vecs)

  def gradient_rows(self, data: Any, batch_size: int) -> tuple[Array, int]:
    """`(h, c)`: rows `h: [R, n]` of gradients over the block's raveled leaves with `hᵀh / c`
    the layer's exact Fisher block for this batch (`_layouts.gradient_rows`)."""
    return _layouts.gradient_rows(self.spec, data, batch_size, self.config.accum_dtype)

  def to_dense(self, factors, cache: Any = None) -> Array:
    """The undamped block as a `[n, n]` matrix over its raveled, concatenated leaves."""
    dtype = self.config.inverse_dtype
    like = [jax.ShapeDtypeStruct(s, dtype) for s in self.spec.param_shapes]
    factors = optax.tree_utils.tree_cast(factors, dtype)

    column = lambda e: flat(self.multiply_undamped(factors, unflat(e, like), cache), dtype)
    n = sum(math.prod(s) for s in self.spec.param_shapes)
    return jax.vmap(column, out_axes=1)(jnp.eye(n, dtype=dtype))

  def cholesky_factor(self, c, inverse: bool):
    """`c`, a cached Cholesky factor (inverse), or an error naming the option it needs."""
    if c is None:
      option = "compute_cholesky_inverse" if inverse else "compute_cholesky"
      raise ValueError(
        f"block `{self.name}`: Cholesky products need {option}=True in the estimator."
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
  parts = jnp.split(x, np.cumsum([math.prod(v.shape) for v in like])[:-1])
  return [p.reshape(v.shape).astype(v.dtype) for p, v in zip(parts, like)]


def map_factorisations(fn, *args):
  """`fn` over the leading axis of `args`: vmapped where `batched_factorisations()`."""
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

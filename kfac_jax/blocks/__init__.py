"""Curvature blocks: one per layer, chosen from the layer kind and its approximation."""

import jax

from kfac_jax.blocks import _kronecker
from kfac_jax.blocks._base import Block as Block
from kfac_jax.blocks._base import BlockConfig as BlockConfig
from kfac_jax.blocks._base import DampingMode as DampingMode
from kfac_jax.blocks._base import FactorSolve as FactorSolve
from kfac_jax.blocks._base import StackedUses as StackedUses
from kfac_jax.blocks._base import batched_factorisations as batched_factorisations
from kfac_jax.blocks._base import compute_caches as compute_caches
from kfac_jax.blocks._concat import ConcatBlock as ConcatBlock
from kfac_jax.blocks._ekfac import EKFACBlock as EKFACBlock
from kfac_jax.blocks._generic import DiagonalBlock as DiagonalBlock
from kfac_jax.blocks._generic import FullBlock as FullBlock
from kfac_jax.blocks._kronecker import KroneckerBlock as KroneckerBlock
from kfac_jax.blocks._shared import SeriesKroneckerBlock as SeriesKroneckerBlock
from kfac_jax.blocks._stacked import StackedBlock as StackedBlock
from kfac_jax.blocks._state import DiagonalCache as DiagonalCache
from kfac_jax.blocks._state import DiagonalFactors as DiagonalFactors
from kfac_jax.blocks._state import EKFACCache as EKFACCache
from kfac_jax.blocks._state import EKFACFactors as EKFACFactors
from kfac_jax.blocks._state import FactorCache as FactorCache
from kfac_jax.blocks._state import FullCache as FullCache
from kfac_jax.blocks._state import FullFactors as FullFactors
from kfac_jax.blocks._state import KroneckerCache as KroneckerCache
from kfac_jax.blocks._state import KroneckerFactors as KroneckerFactors
from kfac_jax.blocks._state import SeriesCache as SeriesCache
from kfac_jax.blocks._state import SeriesFactors as SeriesFactors
from kfac_jax.blocks._terms import KroneckerSumBlock as KroneckerSumBlock
from kfac_jax.blocks._terms import TermsCache as TermsCache

# The block classes that compute layers, each serving its (kind, approximation) pairs (unique).
BLOCK_CLASSES: tuple[type[Block], ...] = (
  KroneckerBlock,
  EKFACBlock,
  SeriesKroneckerBlock,
  KroneckerSumBlock,
  DiagonalBlock,
  FullBlock,
)
_BLOCKS = {pair: cls for cls in BLOCK_CLASSES for pair in cls.serves}


def block_class(spec) -> type[Block]:
  """A wrapper for concatenated leaves or a stack, else the user's, else `(kind, approx)`'s."""
  if spec.concat:
    return ConcatBlock
  if spec.stack_size:
    return StackedBlock
  if spec.block is not None:
    return spec.block
  try:
    return _BLOCKS[(spec.kind, spec.approx)]
  except KeyError:
    choices = sorted(a for k, a in _BLOCKS if k == spec.kind)
    raise ValueError(
      f"layer `{spec.name}` ({spec.kind}) has no {spec.approx!r} block; choose one of {choices}."
    ) from None


def blocked_note(spec) -> str:
  """The `LayerSpec.note` on a layer's blocked factor sides (`_kronecker.blocked_note`)."""
  return _kronecker.blocked_note(spec) if block_class(spec) is KroneckerBlock else ""


def factor_shapes_for(spec) -> tuple[tuple[int, ...], ...]:
  """The factor shapes the layer's block will keep, before any block exists."""
  return block_class(spec).factor_shapes_for(spec)


def make_block(spec, config: BlockConfig) -> Block:
  """The block of a layer (`block_class`), wrapping its inner block where needed."""
  cls = block_class(spec)
  if cls is ConcatBlock:
    return ConcatBlock(spec, config, make_block(spec.logical, config))
  if cls is StackedBlock:
    return StackedBlock(spec, config, make_block(spec.stack_inner, config))
  block = cls(spec, config)
  if spec.block is not None:
    check_user_block(block)
  return block


def check_class(cls, where: str) -> None:
  """TypeError unless `cls` is a concrete `Block` subclass (`where`: its config entry)."""
  if not (isinstance(cls, type) and issubclass(cls, Block)):
    raise TypeError(
      f"{where} must be a subclass of kfac_jax.Block (see its abstract methods), got {cls!r}."
    )
  if cls in (ConcatBlock, StackedBlock):
    raise TypeError(f"{where}: {cls.__name__} wraps another block; name the block it wraps.")
  missing = sorted(getattr(cls, "__abstractmethods__", ()))
  if missing:
    raise TypeError(f"{where}: {cls.__name__} does not implement {missing} (see kfac_jax.Block).")


def tree_shapes(tree) -> tuple:
  """`tree`'s structure and its leaves' `(shape, dtype)`, for comparing two pytrees."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, [(tuple(x.shape), str(x.dtype)) for x in leaves]


def check_user_block(block: Block) -> None:
  """ValueError naming the layer unless a user's block (`LayerConfig.blocks`) has state and
  products of the shapes the estimator needs (checked with `jax.eval_shape`: nothing runs)."""
  spec, config = block.spec, block.config
  who = f"layer `{spec.name}`: the block {type(block).__name__} (LayerConfig.blocks)"
  like = [jax.ShapeDtypeStruct(s, config.inverse_dtype) for s in spec.param_shapes]

  def shapes(step, fn, *args):
    try:
      return jax.eval_shape(fn, *args)
    except Exception as err:
      raise ValueError(f"{who} fails in {step} while tracing: {type(err).__name__}: {err}") from err

  cast = lambda x: jax.ShapeDtypeStruct(x.shape, config.inverse_dtype)  # As `compute_caches`.
  factors = jax.tree_util.tree_map(cast, shapes("init_factors", block.init_factors))
  cache = shapes("init_cache", block.init_cache)
  damping = jax.ShapeDtypeStruct((), config.inverse_dtype)
  computed = shapes("compute_cache", block.compute_cache, factors, damping)
  if tree_shapes(computed) != tree_shapes(cache):
    raise ValueError(
      f"{who}: compute_cache returns {tree_shapes(computed)}, but init_cache returns "
      f"{tree_shapes(cache)}; both must give the same structure, shapes and dtypes."
    )
  want = [tuple(s) for s in spec.param_shapes]
  for e in (1, *config.cached_exps):
    fn = lambda f, c, *v, e=e: block.multiply_matpower(f, c, list(v), e)
    out = shapes("multiply_matpower", fn, factors, cache, *like)
    got = [tuple(x.shape) for x in out] if isinstance(out, (list, tuple)) else out
    if got != want:
      raise ValueError(
        f"{who}: multiply_matpower(..., exp={e}) returns {got}; it must return one array per "
        f"parameter leaf of the layer, shaped {want} ({list(spec.param_paths)})."
      )

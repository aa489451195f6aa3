"""Choosing each layer's curvature approximation: `LayerConfig` and the size policy (precedence,
globs, blocked sides: docs/approximations.rst; `defaults` do not apply to shared layers).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import types
from collections.abc import Mapping, Sequence
from typing import Any

from kfac_jax.scan import _kinds

# The library defaults: a factor side is a matrix up to MAX_FACTOR_DIM entries (in blocks of about
# BLOCK_SIZE), a diagonal above.
MAX_FACTOR_DIM = 16384
BLOCK_SIZE = 1024


def _frozen(mapping, name: str) -> Mapping[str, str]:
  if mapping is not None and not isinstance(mapping, Mapping):
    raise TypeError(f"LayerConfig: `{name}` must be a mapping, got {type(mapping).__name__}.")
  return types.MappingProxyType(dict(mapping or {}))


@dataclasses.dataclass(frozen=True)
class LayerConfig:
  """Which curvature approximation each layer gets; accepted as `layers=` everywhere.

  Patterns are globs over a layer's name and parameter paths; in each mapping the first matching
  pattern wins, and every pattern must match some layer (docs: approximations, layers).

  Attributes:
    defaults: per layer kind ("dense", "conv", "embedding", "scale_and_shift", "generic"), the
      approximation used when nothing more specific is said, e.g. `{"dense": "kron_in_diag"}`.
    overrides: pattern → approximation, of single-use or shared layers, e.g.
      `{"params/Dense_0/*": "full"}`; a manual tag's explicit `approx=` wins over patterns.
    linked: tuple of patterns → "full" or "diagonal": the matched leaves share one generic
      block, e.g. `{("params/enc/*", "params/dec/*"): "full"}`.
    max_factor_dim: the largest factor side (a bias row not counted) kept as a matrix where the
      approximation is not chosen by name; wider sides become diagonal. None: no limit.
    block_size: a wider factor side (a bias row not counted) is kept as diagonal blocks of about
      this size; None: sides kept whole.
    block_sizes: pattern → block size (or None) for the matched layers, over `block_size`.
    blocks: pattern → a `kfac_jax.Block` subclass computing the matched layers' (or uncovered
      parameters') curvature instead of the library's block; it wins over every approximation.

  Example:
    >>> layers = kfac_jax.LayerConfig(defaults={"dense": "kron_out_diag"},
    ...                               overrides={"params/Dense_1/*": "kron"})
    >>> reg = kfac_jax.Registration(loss_fn, params, batch, layers=layers)
    >>> tx = kfac_jax.scale_by_kfac(registration=reg)
  """

  defaults: Mapping[str, str] = dataclasses.field(default_factory=dict)
  overrides: Mapping[str, str] = dataclasses.field(default_factory=dict)
  linked: Mapping[tuple[str, ...], str] = dataclasses.field(default_factory=dict)
  max_factor_dim: int | None = MAX_FACTOR_DIM
  block_size: int | None = BLOCK_SIZE
  block_sizes: Mapping[str, int | None] = dataclasses.field(default_factory=dict)
  blocks: Mapping[str, type] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    kinds = _kinds.KINDS
    _check_size("max_factor_dim", self.max_factor_dim, "no limit")
    _check_size("block_size", self.block_size, "sides kept whole")
    names = ("block_sizes", "overrides", "blocks", "defaults", "linked")
    frozen: dict[str, Mapping] = {name: _frozen(getattr(self, name), name) for name in names}
    for name in names[:3]:
      bad = next((p for p in frozen[name] if not isinstance(p, str) or not p), None)
      if bad is not None:
        raise TypeError(f"LayerConfig.{name}: patterns must be non-empty strings, got {bad!r}.")
    for pattern, size in frozen["block_sizes"].items():
      _check_size(f"block_sizes[{pattern!r}]", size, "sides kept whole")
    for kind, approx in frozen["defaults"].items():
      if kind not in kinds:
        raise ValueError(
          f"LayerConfig.defaults: unknown layer kind {kind!r}; choose from {sorted(kinds)}."
        )
      allowed = kinds[kind].approximations
      _check_approx(f"defaults[{kind!r}]", approx, allowed, f" does not fit {kind} layers")
    every = sorted(_kinds.every_approximation())
    for pattern, approx in frozen["overrides"].items():
      _check_approx(f"overrides[{pattern!r}]", approx, every, " is not an approximation")
    groups = {}
    for patterns, approx in frozen["linked"].items():
      group = (patterns,) if isinstance(patterns, str) else tuple(patterns)
      if not group or not all(isinstance(p, str) and p for p in group):
        raise TypeError(
          f"LayerConfig.linked: each key must be a tuple of glob patterns, got {patterns!r}."
        )
      allowed, why = kinds["generic"].approximations, ": a linked group is one generic block"
      _check_approx(f"linked[{patterns!r}]", approx, allowed, why)
      groups[group] = approx
    for pattern, cls in frozen["blocks"].items():
      if not isinstance(cls, type):  # The scanner checks the class (`blocks.check_class`).
        raise TypeError(
          f"LayerConfig.blocks[{pattern!r}] must be a subclass of kfac_jax.Block, got {cls!r}."
        )
    frozen["linked"] = types.MappingProxyType(groups)
    for name, value in frozen.items():
      object.__setattr__(self, name, value)

  def _key(self) -> tuple:
    values = (getattr(self, f.name) for f in dataclasses.fields(self))
    return tuple(tuple(v.items()) if isinstance(v, Mapping) else v for v in values)

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return isinstance(other, LayerConfig) and self._key() == other._key()

  def block_for(self, names: Sequence[str]) -> tuple[type | None, str | None]:
    """`(class, pattern)` of the first `blocks` pattern matching these names, or `(None, None)`."""
    pattern, cls = first_match(self.blocks, names)
    return cls, pattern

  def block_size_for(self, names: Sequence[str]) -> int | None:
    """The block size of a layer with these names (its name and parameter paths)."""
    pattern, size = first_match(self.block_sizes, names)
    return self.block_size if pattern is None else size


def _check_approx(where: str, approx, choices, why: str) -> None:
  if approx not in choices:
    raise ValueError(f"LayerConfig.{where} = {approx!r}{why}; choose one of {choices}.")


def _check_size(name: str, value, none: str) -> None:
  if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
    raise ValueError(f"LayerConfig.{name} must be a positive int or None ({none}), got {value!r}.")


def check(layers) -> LayerConfig:
  """`layers=` argument: None or a LayerConfig."""
  if layers is None:
    return LayerConfig()
  if not isinstance(layers, LayerConfig):
    raise TypeError(
      f"`layers` must be a kfac_jax.LayerConfig or None, got {type(layers).__name__}: wrap "
      "mappings as kfac_jax.LayerConfig(defaults=..., overrides=..., linked=...)."
    )
  return layers


def matches(pattern: str, names: Sequence[str]) -> bool:
  return any(fnmatch.fnmatchcase(n, pattern) for n in names)


def first_match(mapping: Mapping[str, Any], names: Sequence[str]) -> tuple[str | None, Any]:
  """`(pattern, value)` of the first pattern in `mapping` matching one of `names`, or None's."""
  return next(((p, v) for p, v in mapping.items() if matches(p, names)), (None, None))


def size_policy(
  max_dim: int | None,
  approx: _kinds.Approximation,
  factor_shapes,
  allowed: Sequence[_kinds.Approximation],
  bias: bool = False,
  num_uses: int = 1,
) -> tuple[_kinds.Approximation, str]:
  """`(approximation, note)` after the size policy (note "" if unchanged), from the factor shapes
  under `approx`; with `bias`, the input side ends with a bias row, not counted."""
  if max_dim is None:
    return approx, ""
  if num_uses > 1:  # "kron_indep" has no diagonal-side variant: over the limit, "diagonal".
    side = max((s[-1] for s in factor_shapes if len(s) >= 2), default=0)
    if approx != "kron_indep" or "diagonal" not in allowed or side <= max_dim:
      return approx, ""
    return "diagonal", (
      f"factor side {side} > max_factor_dim {max_dim} on a layer used {num_uses} times: diagonal"
    )
  if approx == "full" and "diagonal" in allowed:
    ((n, _),) = factor_shapes
    note = f"{n} parameters > max_factor_dim {max_dim}: diagonal instead of a full block"
    return ("diagonal", note) if n > max_dim else (approx, "")
  if approx not in ("kron", "kron_in_diag", "kron_out_diag", "ekfac"):
    return approx, ""
  # Over the limit EKFAC becomes the kron variant with the big side(s) diagonal, as "kron" would.
  sa, sg = factor_shapes
  diag = [approx == "kron_in_diag", approx == "kron_out_diag"]
  big = []
  for side, shape, label, extra in ((0, sa, "input", int(bias)), (1, sg, "output", 0)):
    if len(shape) >= 2 and shape[-1] - extra > max_dim and not diag[side]:
      diag[side] = True
      big.append(f"{label} side {shape[-1]}")
  new = _kinds.KRON[diag[0] + 2 * diag[1]]  # "kron", then input, output, both sides diagonal.
  if not big or new not in allowed:
    return approx, ""
  return new, (f"{' and '.join(big)} > max_factor_dim {max_dim}: kept as its diagonal")

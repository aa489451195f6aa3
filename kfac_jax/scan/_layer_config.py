"""Choosing each layer's curvature approximation: defaults per kind, path patterns, linked groups.

Precedence, highest first, for a layer the scanner registers:

  1. a manual layer tag's explicit `approx=` (the tag sits next to the layer's code, so it is the
     most specific statement there is);
  2. the first pattern of `LayerConfig.overrides`, in mapping order, that matches the layer;
  3. `LayerConfig.defaults[kind]`;
  4. the library default (the kind's record, `_kinds.default_approx`; depthwise convolutions
     "diagonal").

Patterns are shell-style globs (`fnmatch.fnmatchcase`: `*` matches any run of characters,
slashes included; `?` one character; `[ab]` a set), matched against the whole layer name (e.g.
`params/Dense_0`) and against each of its parameter paths (`params/Dense_0/kernel`); a layer
matches when any of them does. Globs were chosen over regexes because parameter paths are
slash-separated names, for which `params/*/kernel` reads naturally and needs no escaping.

Shared layers (a parameter used several times: tied weights, the steps of an unrolled scan, see
`_kinds.LayerKind.shared`) take their approximation from a manual tag's `approx=`, else from the
first matching `overrides` pattern (which may name "kron_series_1" / "kron_series_2" for a
recurrence), else their kind's shared default ("kron_indep"; "full" for scale-and-shift).
`defaults` do not apply to them: those name single-use approximations. A pattern choosing an
approximation that a matched layer cannot take is an error naming the pattern and the layer.

Blocked factors. A Kronecker factor side (A or G of a dense, convolution or embedding layer)
with more than `block_size` entries, a bias row not counted, is kept as the diagonal blocks of
the factor, each of about `block_size` (`blocks._blocked`): memory O(n·B) instead of O(n²). It
applies to every such layer, whatever chose its approximation; `block_sizes` patterns set it per
layer (None: that layer's sides whole). `LayerSpec.note` names the blocked sides.

Size policy. A layer whose approximation was not chosen for it by name (no manual `approx=`, no
matching `overrides` pattern) keeps no factor side larger than `max_factor_dim` (a bias row not
counted) as a matrix: a dense, convolution or embedding layer with a larger input / output side
keeps that side as its diagonal ("kron" becomes "kron_in_diag", "kron_out_diag" or
"kron_both_diag"), and a "full" block of more than `max_factor_dim` parameters (a large
scale-and-shift table) becomes "diagonal". The layer's `LayerSpec.note` says why, and `summary`
prints it. An explicit per-layer choice is taken as asked, whatever its size.

Linked groups (TF K-FAC's `define_linked_parameters`) put every parameter leaf matched by a
group's patterns into one generic block, "full" (the exact Fisher block of those parameters, the
default) or "diagonal". A group must hold whole layers: a group holding the kernel of a dense
layer but not its bias is an error, as is a group pattern that matches nothing or a leaf in two
groups.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import types
from collections.abc import Mapping, Sequence

from kfac_jax.scan import _kinds
from kfac_jax.scan._kinds import Approximation

# The library defaults. A side of up to MAX_FACTOR_DIM entries is kept as a matrix, in blocks of
# about BLOCK_SIZE above that; wider sides (vocabulary-size heads) are kept as their diagonal.
MAX_FACTOR_DIM = 16384
BLOCK_SIZE = 1024


def _frozen(mapping, name: str) -> Mapping[str, str]:
  if mapping is None:
    return types.MappingProxyType({})
  if not isinstance(mapping, Mapping):
    raise TypeError(f"LayerConfig: `{name}` must be a mapping, got {type(mapping).__name__}.")
  return types.MappingProxyType(dict(mapping))


@dataclasses.dataclass(frozen=True)
class LayerConfig:
  """Which curvature approximation each layer gets; accepted as `layers=` everywhere.

  Attributes:
    defaults: per layer kind ("dense", "conv", "embedding", "scale_and_shift", "generic"), the
      approximation used when nothing more specific is said, e.g. `{"dense": "kron_in_diag"}`.
    overrides: glob pattern → approximation, e.g. `{"params/Dense_0/*": "full"}`; the first
      matching pattern wins. Every pattern must match some layer. A manual tag's explicit
      `approx=` wins over patterns. Patterns also choose the approximation of shared layers,
      e.g. `{"params/RNN_0/*": "kron_series_2"}` (module docstring).
    linked: tuple of patterns → "full" or "diagonal": the matched leaves share one generic
      block, e.g. `{("params/enc/*", "params/dec/*"): "full"}`.
    max_factor_dim: the largest factor side (a bias row not counted) kept as a matrix, whole
      or in blocks, for layers whose approximation comes from `defaults` or the library
      default (module docstring); None: no limit. The default, 16384, keeps the hidden sides
      of models up to 4k wide (a 4x MLP) as blocks and turns the output side of a 32k–256k
      vocabulary head into a vector: a 65,536-way side in blocks of 1024 would be 512 MiB with
      its inverse, against 256 KiB as a diagonal, where the head's other side may be as narrow
      as the model.
    block_size: a factor side with more entries than this (a bias row not counted) is kept as
      the diagonal blocks of its factor, of about this size (module docstring); None: sides
      kept whole. The default, 1024, keeps a side of n entries in n·1024 values (twice that
      with its inverse), at most twice a layer's parameters when its other side has 1024
      entries or more.
    block_sizes: glob pattern → block size (or None: sides kept whole) for the matched layers,
      e.g. `{"params/head/*": None}`; the first matching pattern wins over `block_size`. Every
      pattern must match some layer.

  Example:
    >>> layers = kfac_jax.LayerConfig(defaults={"dense": "kron_out_diag"},
    ...                               overrides={"params/head/*": "kron"})
    >>> tx = kfac_jax.scale_by_kfac(loss_fn, batch, config=kfac_jax.Config(layers=layers))
  """

  defaults: Mapping[str, str] = dataclasses.field(default_factory=dict)
  overrides: Mapping[str, str] = dataclasses.field(default_factory=dict)
  linked: Mapping[tuple[str, ...], str] = dataclasses.field(default_factory=dict)
  max_factor_dim: int | None = MAX_FACTOR_DIM
  block_size: int | None = BLOCK_SIZE
  block_sizes: Mapping[str, int | None] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    kinds = _kinds.KINDS
    _check_size("max_factor_dim", self.max_factor_dim, "no limit")
    _check_size("block_size", self.block_size, "sides kept whole")
    block_sizes = _frozen(self.block_sizes, "block_sizes")
    for pattern, size in block_sizes.items():
      if not isinstance(pattern, str) or not pattern:
        raise TypeError(
          f"LayerConfig.block_sizes: patterns must be non-empty strings, got {pattern!r}."
        )
      _check_size(f"block_sizes[{pattern!r}]", size, "sides kept whole")
    defaults = _frozen(self.defaults, "defaults")
    for kind, approx in defaults.items():
      if kind not in kinds:
        raise ValueError(
          f"LayerConfig.defaults: unknown layer kind {kind!r}; choose from {sorted(kinds)}."
        )
      if approx not in kinds[kind].approximations:
        raise ValueError(
          f"LayerConfig.defaults[{kind!r}] = {approx!r} does not fit {kind} layers; choose one "
          f"of {kinds[kind].approximations}."
        )
    overrides = _frozen(self.overrides, "overrides")
    every = sorted(_kinds.every_approximation())
    for pattern, approx in overrides.items():
      if not isinstance(pattern, str) or not pattern:
        raise TypeError(
          f"LayerConfig.overrides: patterns must be non-empty strings, got {pattern!r}."
        )
      if approx not in every:
        raise ValueError(
          f"LayerConfig.overrides[{pattern!r}] = {approx!r} is not an approximation; choose "
          f"one of {every}."
        )
    linked = _frozen(self.linked, "linked")
    groups = {}
    for patterns, approx in linked.items():
      group = (patterns,) if isinstance(patterns, str) else tuple(patterns)
      if not group or not all(isinstance(p, str) and p for p in group):
        raise TypeError(
          f"LayerConfig.linked: each key must be a tuple of glob patterns, got {patterns!r}."
        )
      if approx not in kinds["generic"].approximations:
        raise ValueError(
          f"LayerConfig.linked[{patterns!r}] = {approx!r}: a linked group is one generic "
          f"block; choose one of {kinds['generic'].approximations}."
        )
      groups[group] = approx
    object.__setattr__(self, "defaults", defaults)
    object.__setattr__(self, "overrides", overrides)
    object.__setattr__(self, "linked", types.MappingProxyType(groups))
    object.__setattr__(self, "block_sizes", block_sizes)

  def _key(self) -> tuple:
    return (
      tuple(self.defaults.items()),
      tuple(self.overrides.items()),
      tuple(self.linked.items()),
      self.max_factor_dim,
      self.block_size,
      tuple(self.block_sizes.items()),
    )

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return isinstance(other, LayerConfig) and self._key() == other._key()

  def block_size_for(self, names: Sequence[str]) -> int | None:
    """The block size of a layer with these names (its name and parameter paths)."""
    for pattern, size in self.block_sizes.items():
      if matches(pattern, names):
        return size
    return self.block_size


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


_DIAG_SIDES: dict[tuple[Approximation, str], Approximation] = {  # (kron family, side) -> approx.
  ("kron", "in"): "kron_in_diag",
  ("kron", "out"): "kron_out_diag",
  ("kron_in_diag", "out"): "kron_both_diag",
  ("kron_out_diag", "in"): "kron_both_diag",
  ("kron_in_diag", "in"): "kron_in_diag",
  ("kron_out_diag", "out"): "kron_out_diag",
  ("kron_both_diag", "in"): "kron_both_diag",
  ("kron_both_diag", "out"): "kron_both_diag",
}


def size_policy(
  max_dim: int | None,
  approx: Approximation,
  factor_shapes,
  allowed: Sequence[Approximation],
  bias: bool = False,
) -> tuple[Approximation, str]:
  """`(approximation, note)` after the size policy (module docstring); note "" if unchanged.

  `factor_shapes` are the layer's factor shapes under `approx`, as its block keeps them
  (`blocks.factor_shapes_for`): a factor with two or more axes is a matrix (after a leading
  group axis for grouped convolutions) whose side is its last axis; a vector (an embedding's
  input side, a side already kept as its diagonal) has no side to shrink. `bias`: the input
  side ends with a bias row, which is not counted against `max_dim`.
  """
  if max_dim is None:
    return approx, ""
  if approx == "full" and "diagonal" in allowed:
    ((n, _),) = factor_shapes
    if n <= max_dim:
      return approx, ""
    return (
      "diagonal",
      f"{n} parameters > max_factor_dim {max_dim}: diagonal instead of a full block",
    )
  if approx not in ("kron", "kron_in_diag", "kron_out_diag", "ekfac"):
    return approx, ""
  sa, sg = factor_shapes
  # EKFAC keeps both full eigenbases: over the limit it becomes the kron variant with the big
  # side(s) diagonal, as "kron" would.
  new: Approximation = "kron" if approx == "ekfac" else approx
  big = []
  for side, shape, label, extra in (("in", sa, "input", int(bias)), ("out", sg, "output", 0)):
    if len(shape) >= 2 and shape[-1] - extra > max_dim and _DIAG_SIDES[(new, side)] != new:
      new = _DIAG_SIDES[(new, side)]
      big.append(f"{label} side {shape[-1]}")
  if not big or new == approx or new not in allowed:
    return approx, ""
  return new, (f"{' and '.join(big)} > max_factor_dim {max_dim}: kept as its diagonal")


def shared_size_policy(
  max_dim: int | None,
  approx: Approximation,
  factor_shapes,
  allowed: Sequence[Approximation],
  num_uses: int,
) -> tuple[Approximation, str]:
  """`size_policy` for a layer used `num_uses` times: "kron_indep" has no diagonal-side
  variant, so a matrix side above the limit makes the block "diagonal" (the exact per-example
  diagonal, O(n)) where the kind allows it (`allowed`: the kind's `LayerKind.shared`)."""
  if max_dim is None or approx != "kron_indep" or "diagonal" not in allowed:
    return approx, ""
  side = max((s[-1] for s in factor_shapes if len(s) >= 2), default=0)
  if side <= max_dim:
    return approx, ""
  return "diagonal", (
    f"factor side {side} > max_factor_dim {max_dim} on a layer used {num_uses} times: diagonal"
  )


def resolve(
  config: LayerConfig, kind: str, names: Sequence[str], builtin: str
) -> tuple[str, str | None]:
  """(approximation, the pattern that chose it or None) for a layer without an explicit one.

  `names` are the layer's name and parameter paths.
  """
  for pattern, approx in config.overrides.items():
    if matches(pattern, names):
      return approx, pattern
  return config.defaults.get(kind, builtin), None

"""Choosing each layer's curvature approximation: defaults per kind, path patterns, linked groups.

Precedence, highest first, for a layer the scanner registers:

  1. a manual layer tag's explicit `approx=` (the tag sits next to the layer's code, so it is the
     most specific statement there is);
  2. the first pattern of `LayerConfig.overrides`, in mapping order, that matches the layer;
  3. `LayerConfig.defaults[kind]`;
  4. the library default (`_specs.DEFAULT_APPROX`; depthwise convolutions "diagonal").

Patterns are shell-style globs (`fnmatch.fnmatchcase`: `*` matches any run of characters,
slashes included; `?` one character; `[ab]` a set), matched against the whole layer name (e.g.
`params/Dense_0`) and against each of its parameter paths (`params/Dense_0/kernel`); a layer
matches when any of them does. Globs were chosen over regexes because parameter paths are
slash-separated names, for which `params/*/kernel` reads naturally and needs no escaping.

Shared layers (a parameter used several times: tied weights, the steps of an unrolled scan, see
`_specs.SHARED_BY_KIND`) take their approximation from a manual tag's `approx=`, else from the
first matching `overrides` pattern (which may name "kron_series_1" / "kron_series_2" for a
recurrence), else their kind's shared default ("kron_indep"; "full" for scale-and-shift).
`defaults` do not apply to them: those name single-use approximations. A pattern choosing an
approximation that a matched layer cannot take is an error naming the pattern and the layer.

Size policy. A layer whose approximation was not chosen for it by name (no manual `approx=`, no
matching `overrides` pattern) keeps no factor side larger than `max_factor_dim`: a dense,
convolution or embedding layer with a larger input / output side keeps that side as its
diagonal ("kron" becomes "kron_in_diag", "kron_out_diag" or "kron_both_diag"), and a "full"
block of more than `max_factor_dim` parameters (a large scale-and-shift table) becomes
"diagonal". The layer's `LayerSpec.note` says why, and `summary` prints it. An explicit
per-layer choice is taken as asked, whatever its size.

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

from kfac_jax import _specs


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
    max_factor_dim: the largest factor side kept as a matrix for layers whose approximation
      comes from `defaults` or the library default (module docstring); None: no limit. The
      default, 8192, keeps full input factors for models up to 8k wide (a 8192² float32 factor
      is 256 MiB; with its inverse, 512 MiB, about a quarter of such a model's 8192 × 32k
      vocabulary head) and turns the output side of every 32k–256k vocabulary head into a
      vector: a 65,536-way output factor would be 16 GiB as a matrix (64 GiB with its caches)
      and is 256 KiB as a diagonal. Hidden layers wider than 8192 (a 4× MLP of a 4k model)
      also get a diagonal side on their wide side.

  Example:
    >>> layers = kfac_jax.LayerConfig(defaults={"dense": "kron_out_diag"},
    ...                               overrides={"params/head/*": "kron"})
    >>> tx = kfac_jax.scale_by_kfac(loss_fn, batch, config=kfac_jax.Config(layers=layers))
  """

  defaults: Mapping[str, str] = dataclasses.field(default_factory=dict)
  overrides: Mapping[str, str] = dataclasses.field(default_factory=dict)
  linked: Mapping[tuple[str, ...], str] = dataclasses.field(default_factory=dict)
  max_factor_dim: int | None = 8192

  def __post_init__(self):
    approximations = _specs.APPROXIMATIONS
    m = self.max_factor_dim
    if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
      raise ValueError(
        f"LayerConfig.max_factor_dim must be a positive int or None (no limit), got {m!r}."
      )
    defaults = _frozen(self.defaults, "defaults")
    for kind, approx in defaults.items():
      if kind not in approximations:
        raise ValueError(
          f"LayerConfig.defaults: unknown layer kind {kind!r}; choose from "
          f"{sorted(approximations)}."
        )
      if approx not in approximations[kind]:
        raise ValueError(
          f"LayerConfig.defaults[{kind!r}] = {approx!r} does not fit {kind} layers; choose one "
          f"of {approximations[kind]}."
        )
    overrides = _frozen(self.overrides, "overrides")
    every = sorted(
      {a for table in (approximations, _specs.SHARED_BY_KIND) for v in table.values() for a in v}
    )
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
      if approx not in approximations["generic"]:
        raise ValueError(
          f"LayerConfig.linked[{patterns!r}] = {approx!r}: a linked group is one generic "
          f"block; choose one of {approximations['generic']}."
        )
      groups[group] = approx
    object.__setattr__(self, "defaults", defaults)
    object.__setattr__(self, "overrides", overrides)
    object.__setattr__(self, "linked", types.MappingProxyType(groups))

  def __hash__(self):
    return hash(
      (
        tuple(self.defaults.items()),
        tuple(self.overrides.items()),
        tuple(self.linked.items()),
        self.max_factor_dim,
      )
    )

  def __eq__(self, other):
    return isinstance(other, LayerConfig) and (
      dict(self.defaults),
      dict(self.overrides),
      dict(self.linked),
      self.max_factor_dim,
    ) == (dict(other.defaults), dict(other.overrides), dict(other.linked), other.max_factor_dim)


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


_DIAG_SIDES = {  # (kron-family approximation, side made diagonal) -> approximation.
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
  max_dim: int | None, approx: str, factor_shapes, allowed: Sequence[str]
) -> tuple[str, str]:
  """`(approximation, note)` after the size policy (module docstring); note "" if unchanged.

  `factor_shapes` are the layer's factor shapes under `approx`, as its block keeps them
  (`blocks.factor_shapes_for`): a factor with two or more axes is a matrix (after a leading
  group axis for grouped convolutions) whose side is its last axis; a vector (an embedding's
  input side, a side already kept as its diagonal) has no side to shrink.
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
  new, big = ("kron" if approx == "ekfac" else approx), []
  for side, shape, label in (("in", sa, "input"), ("out", sg, "output")):
    if len(shape) >= 2 and shape[-1] > max_dim and _DIAG_SIDES[(new, side)] != new:
      new = _DIAG_SIDES[(new, side)]
      big.append(f"{label} side {shape[-1]}")
  if not big or new == approx or new not in allowed:
    return approx, ""
  return new, (f"{' and '.join(big)} > max_factor_dim {max_dim}: kept as its diagonal")


def shared_size_policy(
  max_dim: int | None, approx: str, factor_shapes, allowed: Sequence[str], num_uses: int
) -> tuple[str, str]:
  """`size_policy` for a layer used `num_uses` times: "kron_indep" has no diagonal-side
  variant, so a matrix side above the limit makes the block "diagonal" (the exact per-example
  diagonal, O(n)) where the kind allows it (`allowed`: `_specs.SHARED_BY_KIND[kind]`)."""
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

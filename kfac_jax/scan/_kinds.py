"""The layer vocabulary: each layer kind declared once, as one `LayerKind` record.

Adding a kind: its name in `Kind`, its record and matcher here, and its layout in
`blocks/_layouts.py` if its layers are products by a parameter matrix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, get_args

import numpy as np

from kfac_jax import _specs
from kfac_jax._specs import Approximation, Kind
from kfac_jax.blocks._layouts import KRON, GroupedDenseInfo
from kfac_jax.scan import _graph, _matchers, _matchers_embed, _stacked

# Shared-layer approximations of correlations between successive uses (a recurrence's steps).
SERIES: tuple[Approximation, ...] = ("kron_series_1", "kron_series_2")

# The automatic passes, in order: kernels claim their biases before a shift could take them.
Pass = Literal["kernels", "gathers", "elementwise"]
PASSES: tuple[Pass, ...] = get_args(Pass)

Matcher = Callable[[Any, int, dict[int, str]], "_matchers.Match | None"]


@dataclasses.dataclass(frozen=True)
class MatcherEntry:
  """One automatic matcher of a kind, its pass and its rank there (lower ranks tried first)."""

  pass_: Pass
  rank: int
  fn: Matcher


@dataclasses.dataclass(frozen=True)
class LayerKind:
  """Everything the tracer knows about one layer kind."""

  name: Kind  # As `LayerSpec.kind` and `LayerConfig.defaults` spell it.
  info: type  # The type of `LayerSpec.info` for the kind's layers.
  approximations: tuple[Approximation, ...]  # A single-use layer's; the first is the default.
  # A layer used several times: the default first ("kron" read as "kron_indep"); () for none.
  shared: tuple[Approximation, ...] = ()
  matchers: tuple[MatcherEntry, ...] = ()
  read_tag: Callable[[Any, Any], _matchers.Match] | None = None  # Reads `register_<name>`.
  default: Callable[[Any], tuple[Approximation, str] | None] | None = None  # By shape, or None.
  # The first input holds rows of examples: a match whose input comes from parameters and
  # constants alone is left to the fallback.
  batch_rows: bool = False


def _scale_shift_default(info: _specs.ScaleShiftInfo) -> tuple[Approximation, str] | None:
  # A shift-only table over several axes: its "full" block would be quadratic in L·D.
  if info.has_scale or len(info.feature_shape) < 2:
    return None
  nd, nf = len(info.output_shape), len(info.feature_shape)
  start = nd - nf if info.feature_axis is None else info.feature_axis
  entries = info.feature_entries()
  if entries is not None and len(np.unique(entries)) < entries.size:
    what = "gathered at constant positions with repeats, e.g. a relative-position bias"
  elif entries is not None:
    what = "positional embedding read at constant positions"
  elif all(  # One entry per position and feature, not a bias repeated over positions.
    info.output_shape[a] == 1
    for a in range(nd)
    if a != info.batch_axis and not start <= a < start + nf
  ):
    what = "positional embedding or learned tokens"
  else:
    what = "a bias over several axes, the same at every position"
  shape = "x".join(map(str, info.feature_shape))
  return "diagonal", f"shift-only table {shape} ({what}): diagonal"


def match_grouped_dense(ix, i, claimed):
  """A dense map per group (`nn.ConvLocal`): a `dot_general` batched over the groups, its bias."""
  found = _matchers.sole_param_operand(ix, i, "dot_general")
  if found is None or found[0] >= ix.n_params or found[0] in claimed:
    return None
  k_leaf, k_pos, fe = found[0], found[1], ix.g.eqns[i]
  k_atom, x_atom = fe.ins[k_pos], fe.ins[1 - k_pos]
  if any(s.op != "cast" for s in ix.origin[k_atom][1]):
    return None
  k_c, x_c, k_b, x_b = _matchers.dot_dims(fe.params["dimension_numbers"], k_pos)
  k_shape, x_shape = _graph.shape_of(k_atom), _graph.shape_of(x_atom)
  g = len(k_b)
  k_free = tuple(d for d in range(len(k_shape)) if d not in k_b and d not in k_c)
  x_free = tuple(d for d in range(len(x_shape)) if d not in x_b and d not in x_c)
  if not g or not k_c or not k_free or not x_free:
    return None
  grid, n_free, n_out = tuple(k_shape[d] for d in k_b), len(x_free), len(k_free)
  out_shape = tuple(k_shape[d] for d in k_free)
  # The product's axes: the groups (batch dimensions), then the lhs's and the rhs's free axes.
  rows, outs = [("row", d) for d in range(n_free)], [("out", d) for d in range(n_out)]
  labels = [("grid", d) for d in range(g)] + (rows + outs if k_pos == 1 else outs + rows)
  out_key = fe.outs[0]
  use = _matchers.only_consumer(ix, out_key)
  if use is not None and ix.g.eqns[use[0]].name == "transpose":
    t = ix.g.eqns[use[0]]
    labels = [labels[int(d)] for d in t.params["permutation"]]
    out_key = t.outs[0]
  canonical = rows + [("grid", d) for d in range(g)] + outs
  leaves = [k_leaf]
  # `[rows..., *groups, out...]`: a single-use bias `[*groups, out...]` may follow.
  bias = _matchers.added_leaf(ix, out_key, claimed) if labels == canonical else None
  if (
    bias is not None
    and bias[0] < ix.n_params
    and _graph.shape_of(bias[2]) == (1,) * n_free + grid + out_shape
    and all(s.op in ("cast", "reshape") for s in bias[1])
  ):
    leaves.append(bias[0])
    out_key = bias[3].outs[0]
  info = GroupedDenseInfo(
    kernel_view=tuple(ix.origin[k_atom][1]),
    kernel_perm=tuple(k_b) + tuple(k_c) + k_free,
    grid=tuple(int(s) for s in grid),
    in_dim=int(np.prod([k_shape[d] for d in k_c])),
    out_dim=int(np.prod(out_shape)),
    x_perm=x_free + tuple(x_b) + tuple(x_c),
    out_perm=tuple(labels.index(lab) for lab in canonical),
  )
  return _matchers.Match.single("grouped_dense", leaves, info, out_key, (x_atom,))


KINDS: dict[Kind, LayerKind] = {
  k.name: k
  for k in (
    LayerKind(
      name="dense",
      info=_specs.DenseInfo,
      approximations=(*KRON, "diagonal", "full", "expand", "reduce", "kron_indep", "ekfac"),
      shared=("kron_indep", "kron_series_1", "kron_series_2", "kron_terms", "diagonal", "full"),
      matchers=(
        MatcherEntry("kernels", 0, _stacked.match_batched_dense),
        MatcherEntry("kernels", 20, _matchers.match_dense),
      ),
      read_tag=_matchers.read_dense_tag,
      batch_rows=True,
    ),
    LayerKind(
      name="conv",
      info=_specs.ConvInfo,
      approximations=("kron", "kron_sua", *KRON[1:], "diagonal", "full", "ekfac"),
      shared=("kron_indep", "diagonal", "full"),
      matchers=(MatcherEntry("kernels", 30, _matchers.match_conv),),
      read_tag=_matchers.read_conv_tag,
      # A depthwise kernel's Kronecker factors are per channel; its exact diagonal costs the same.
      default=lambda info: ("diagonal", "") if info.depthwise else None,
      batch_rows=True,
    ),
    LayerKind(
      name="embedding",
      info=_specs.EmbeddingInfo,
      approximations=("kron", "kron_indep", "kron_out_diag"),
      shared=("kron_indep",),
      matchers=(
        # Before `match_dense` would take a one-hot product for a kernel.
        MatcherEntry("kernels", 10, _matchers_embed.match_one_hot_embedding),
        MatcherEntry("gathers", 0, _matchers_embed.match_embedding),
      ),
      read_tag=_matchers.read_embedding_tag,
      batch_rows=True,
    ),
    LayerKind(
      name="scale_and_shift",
      info=_specs.ScaleShiftInfo,
      approximations=("full", "diagonal"),
      shared=("full", "diagonal"),
      matchers=(
        # A stack first: its per-layer parameters span the layer axis too.
        MatcherEntry("elementwise", 0, _stacked.match_stacked_scale_and_shift),
        MatcherEntry("elementwise", 5, _matchers.match_scale_and_shift),
        # Last: a broadcast over the batch nothing else took.
        MatcherEntry("elementwise", 10, _matchers_embed.match_batch_tokens),
      ),
      read_tag=_matchers.read_scale_and_shift_tag,
      default=_scale_shift_default,
    ),
    LayerKind(
      name="grouped_dense",
      info=GroupedDenseInfo,
      approximations=(*KRON, "diagonal", "full"),
      matchers=(MatcherEntry("kernels", 5, match_grouped_dense),),
      batch_rows=True,
    ),
    LayerKind(
      name="generic",
      info=_specs.FallbackInfo,
      approximations=("diagonal", "full"),
      read_tag=_matchers.read_generic_tag,
    ),
  )
}


def passes() -> tuple[tuple[Matcher, ...], ...]:
  """The automatic matchers of every kind, pass by pass, each pass in rank order."""
  entries = [e for k in KINDS.values() for e in k.matchers]
  return tuple(
    tuple(e.fn for e in sorted((e for e in entries if e.pass_ == p), key=lambda e: e.rank))
    for p in PASSES
  )


def every_approximation() -> tuple[Approximation, ...]:
  """Every approximation some kind takes, alone or shared, in `Approximation`'s order."""
  named = {a for k in KINDS.values() for a in k.approximations + k.shared}
  return tuple(a for a in get_args(Approximation) if a in named)


def default_approx(name: Kind, info) -> tuple[Approximation, str]:
  """The library default of a layer of kind `name` with info `info`, and the note on why."""
  record = KINDS[name]
  found = record.default(info) if record.default is not None and info is not None else None
  return found if found is not None else (record.approximations[0], "")

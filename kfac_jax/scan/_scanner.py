"""The scanner: trace `loss_fn(params, batch)`, find loss tags and layers, describe them statically.

The kinds' matchers (`_kinds`) claim leaves by their real uses on the loss tags' backward slice
(`_index`) in the order `_Scanner` gives; leaves left over get a diagonal generic block, a
warning and a reason (`fallback_reason`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np

from kfac_jax import _compat, _tags
from kfac_jax import blocks as _blocks
from kfac_jax._errors import RegistrationCheckError, RegistrationError, UncoveredParametersWarning
from kfac_jax._specs import (  # Re-exported: the names other modules and tests use from here.
  EmbeddingInfo,
  FallbackInfo,
  LayerSpec,
  LossSpec,
  common_prefix,
  kernel_index_matrix,
  param_paths,
)
from kfac_jax.scan import (
  _graph,
  _index,
  _kinds,
  _layer_config,
  _matchers,
  _matchers_shared,
  _stacked,
)

if TYPE_CHECKING:
  from kfac_jax._specs import Approximation


@dataclasses.dataclass(frozen=True, eq=False)
class ScanResult:
  """One scan of `loss_fn` for one `(params, batch)` signature: the flat graph, static specs and
  the graph keys the curvature pass taps (`Registration.scan_batch` keeps one per signature)."""

  graph: _graph.FlatGraph
  layers: tuple[LayerSpec, ...]
  losses: tuple[LossSpec, ...]
  loss_operands: tuple[tuple[_graph.Atom, ...], ...]  # per loss: (prediction, targets?, weight?)
  layer_outputs: tuple[_graph.Key | None, ...]  # per layer: where the perturbation is added
  # Per layer: the input operands the block's statistics need (None for generic layers).
  layer_inputs: tuple[tuple[_graph.Atom, ...] | None, ...]
  # Per layer: the further uses `((output key, inputs), ...)` of a multi-use layer, else ().
  extra_uses: tuple[tuple[tuple[_graph.Key, tuple[_graph.Atom, ...]], ...], ...] = ()
  # With `has_aux`: the treedef of the aux, whose leaves are the graph's outputs after the loss.
  aux_tree: Any = None
  # Loss tags bound only in custom rules: the graph is `loss_fn` as jax.grad runs it (its loss
  # output is zero); the loss, aux and gradient come from differentiating `loss_fn` itself.
  separate_loss: bool = False

  @property
  def batch_size(self) -> int:
    """N, the statistics' normalisation: the largest loss tag's batch."""
    return max(spec.batch_size for spec in self.losses)


def scan(
  loss_fn: Callable,
  params,
  batch,
  *,
  strict: bool = False,
  warn: bool = True,
  layers: _layer_config.LayerConfig | None = None,
  collect: bool = False,
  has_aux: bool = False,
) -> ScanResult:
  """Traces `loss_fn(params, batch)` and registers its loss tags and layers.

  With `has_aux`, `loss_fn` returns `(loss, aux)`, whose aux leaves stay graph outputs after the
  loss (`ScanResult.aux_tree`); with `collect`, the coverage problems are raised together as one
  `RegistrationCheckError`.

  Raises:
    RegistrationError: no loss tag, a malformed manual tag, an approximation that does not fit
      its layer, a bad linked group, a pattern that matches no parameter, or (with `strict`)
      parameters outside any recognised layer.
  """
  layers = _layer_config.check(layers)
  for pattern, cls in layers.blocks.items():
    _blocks.check_class(cls, f"LayerConfig.blocks[{pattern!r}]")
  paths, leaves = param_paths(params), jax.tree.leaves(params)
  _check_dtypes(paths, leaves)
  graph, aux_tree, separate = _trace(loss_fn, params, batch, len(leaves), has_aux)
  losses, loss_operands = _losses(graph)
  roots, shapes = [ops[0] for ops in loss_operands], [np.shape(x) for x in leaves]
  ix = _index.build(graph, len(leaves), paths, shapes, roots, max(s.batch_size for s in losses))
  specs = _Scanner(ix, layers, strict, warn, collect).run()
  specs.sort(key=lambda s: min(s[0].leaf_indices))
  _check_custom_taps(graph, specs)
  firsts = [(s[1][0], s[2][0]) if s[0].multi_tap else s[1:] for s in specs]
  return ScanResult(
    graph=graph,
    layers=tuple(s[0] for s in specs),
    losses=tuple(losses),
    loss_operands=tuple(loss_operands),
    layer_outputs=tuple(f[0] for f in firsts),
    layer_inputs=tuple(f[1] for f in firsts),
    extra_uses=tuple(tuple(zip(s[1][1:], s[2][1:])) if s[0].multi_tap else () for s in specs),
    aux_tree=aux_tree,
    separate_loss=separate,
  )


def _trace(loss_fn, params, batch, n_params: int, has_aux):
  """`(graph, aux treedef, separate_loss)` of `loss_fn` at `(params, batch)` (`ScanResult`)."""
  traced = lambda fn: jax.make_jaxpr(fn, return_shape=True)(params, batch)
  closed, out_shape = traced(loss_fn)
  out_avals = [a.aval for a in closed.jaxpr.outvars]
  if (len(out_avals) != 1 and not has_aux) or not out_avals or out_avals[0].shape != ():
    raise RegistrationError(
      "loss_fn(params, batch) must return one scalar loss, got outputs of shapes "
      f"{[tuple(a.shape) for a in out_avals]}; for `(loss, aux)`, pass has_aux=True."
    )
  graph = _graph.FlatGraph.from_closed_jaxpr(closed, n_params)
  tagged = any(fe.eqn.primitive is _tags.loss_tag_p for fe in graph.eqns)
  customs = _custom_calls(closed.jaxpr)
  # Rules may hold loss tags: trace `loss_fn` as jax.grad runs it, beside tags of the loss only
  # for a call that reads a parameter itself (not relu's rule: the trace costs a linearisation).
  if customs and (not tagged or graph.customs):
    backward = bool(customs - {"custom_jvp_call"})
    closed_d, (_, out_d) = traced(_as_differentiated(loss_fn, has_aux, backward))
    outvars = closed_d.jaxpr.outvars[:1]
    closed_d = _compat.ClosedJaxpr(closed_d.jaxpr.replace(outvars=outvars), closed_d.consts)
    derived = _graph.FlatGraph.from_closed_jaxpr(closed_d, n_params)
    _check_rule_tags(graph, derived, out_shape, out_d)
    if not tagged:
      return derived, None, True
  return graph, jax.tree_util.tree_structure(out_shape[1]) if has_aux else None, False


def _check_dtypes(paths, leaves) -> None:
  """RegistrationError for a parameter leaf that is not real floating-point."""
  for path, leaf in zip(paths, leaves):
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.complexfloating):
      raise RegistrationError(
        f"parameter `{path}` has dtype {dtype}; K-FAC's blocks take real parameters. Keep the "
        "real and imaginary parts as two real leaves and build the complex value in the model "
        "(`w = p['w_re'] + 1j * p['w_im']`); a complex output of real parameters is fine."
      )
    if dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.floating):
      raise RegistrationError(
        f"parameter `{path}` has dtype {dtype}; K-FAC needs floating-point "
        "parameters. Keep integer state out of `params` (pass it in the batch instead)."
      )


# Primitives whose derivative cannot be pulled back (reverse mode).
_NO_REVERSE = frozenset({"while", "pure_callback", "io_callback"})


def _check_custom_taps(graph: _graph.FlatGraph, specs) -> None:
  """RegistrationError: a layer output in a custom call reaches its outputs via `_NO_REVERSE`."""
  if not graph.customs:
    return
  where = {}
  for spec, outs, _ in specs:
    for k in outs if spec.multi_tap else (outs,):
      k = k.keys if isinstance(k, _graph.HoistedTap) else k
      for key in k if isinstance(k, tuple) and k and isinstance(k[0], tuple) else (k,):
        where[key] = spec.name
  for call in graph.customs:
    eqns = graph.eqns[call.start : call.stop]
    reached = {k: where[k] for fe in eqns for k in fe.outs if k in where}
    for fe in eqns:
      hit = next((reached[a] for a in fe.ins if _graph.is_key(a) and a in reached), None)
      if hit is not None and fe.name in _NO_REVERSE:
        raise RegistrationError(
          f"layer `{hit}` sits inside the custom-derivative function `{call.name}` and reaches "
          f"its outputs through `{fe.name}`, which has no reverse-mode derivative, so K-FAC "
          f"cannot take the layer's output gradients. Apply the layer outside `{call.name}` "
          "(pass its output in), or tag the parameter with kfac_jax.register_generic."
        )
      if hit is not None:
        reached.update((k, hit) for k in fe.outs)


def _losses(graph: _graph.FlatGraph) -> tuple[list[LossSpec], list[tuple[_graph.Atom, ...]]]:
  """The loss tags' specs and operands."""
  losses, operands = [], []
  for fe in (fe for fe in graph.eqns if fe.eqn.primitive is _tags.loss_tag_p):
    p, shape = fe.params, _graph.shape_of(fe.ins[0])
    if p.get("under_vmap"):
      raise RegistrationError(
        f"a {p['kind']} loss tag was called inside jax.vmap, where it sees one slice, not the "
        "whole batch. Call the register_*_loss function outside the vmap, on the batched "
        "prediction: `logits = jax.vmap(model)(x); register_softmax_cross_entropy_loss(logits, y)`."
      )
    losses.append(LossSpec(p["kind"], p["var"], p["has_targets"], p["has_weight"], shape[0], shape))
    operands.append(fe.ins)
  if not losses:
    raise RegistrationError(
      "no loss tag found in loss_fn: K-FAC needs the model's predictive distribution. Call "
      "kfac_jax.register_softmax_cross_entropy_loss (or another register_*_loss, or "
      "register_normal_predictive_distribution) on the model output in loss_fn (or in a "
      "jax.custom_jvp rule or custom_vjp fwd / bwd it calls); for the curvature of another "
      "function, pass `kfac_jax.Registration(..., curvature_fn=...)`."
    )
  return losses, operands


# The custom-derivative calls, whose rules may hold loss tags.
_CUSTOM_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _custom_calls(jaxpr) -> set[str]:
  """The custom-derivative primitives `jaxpr` binds, at any depth."""
  found = {e.primitive.name for e in jaxpr.eqns if e.primitive.name in _CUSTOM_CALLS}
  for sub in _compat.subjaxprs(jaxpr):
    found |= _custom_calls(sub)
  return found


def _as_differentiated(loss_fn: Callable, has_aux: bool, backward: bool) -> Callable:
  """`loss_fn` under `jax.vjp` (pulled back on zeros with `backward`), so that the custom rules
  bind their loss tags; returns a zero loss beside `loss_fn`'s outputs."""

  def fn(params, batch):
    f = lambda p: loss_fn(p, batch)
    loss, pull, *aux = jax.vjp(f, params, has_aux=True) if has_aux else jax.vjp(f, params)
    if backward:
      pull(jax.numpy.zeros_like(loss))
    return jax.numpy.zeros((), loss.dtype), (loss, *aux) if has_aux else loss

  return fn


def tag_names(graph: _graph.FlatGraph) -> list[str]:
  """Per loss tag, in graph order: `loss tag #i (register_..., prediction f32[4, 5], at
  file:line in fn)`."""
  names = []
  for i, fe in enumerate(fe for fe in graph.eqns if fe.eqn.primitive is _tags.loss_tag_p):
    fn = fe.params.get("fn", f"a {fe.params['kind']} loss tag")
    where = _compat.source_line(fe.eqn, _PACKAGE_DIR)
    at = f", at {where}" if where else ""
    aval = _graph.aval_of(fe.ins[0]).str_short()
    names.append(f"loss tag #{i + 1} ({fn}, prediction {aval}{at})")
  return names


def _types(tree) -> str:
  return str(jax.tree_util.tree_map(lambda x: f"{x.dtype}{list(x.shape)}", tree)).replace("'", "")


def _check_rule_tags(graph: _graph.FlatGraph, derived: _graph.FlatGraph, out, out_d) -> None:
  """RegistrationError for loss tags both in and outside custom rules, or outside them when a
  rule's primal outputs `out_d` differ from the function's `out`."""
  inside, beside = _only_in(derived, graph), tag_names(graph)
  if inside and beside:
    raise RegistrationError(
      f"loss_fn binds loss tags both inside custom-derivative rules ({'; '.join(inside)}) and "
      f"outside them ({'; '.join(beside)}): tags outside describe the loss, tags in a rule the "
      "curvature of another function (FermiNet's form). Keep tags in one place only; pass a "
      "separate curvature function as `kfac_jax.Registration(..., curvature_fn=...)`."
    )
  layout = lambda t: (jax.tree.structure(t), [(x.shape, x.dtype) for x in jax.tree.leaves(t)])
  if beside and layout(out) != layout(out_d):
    raise RegistrationError(
      "a custom-derivative rule in loss_fn returns primal outputs of other shapes or dtypes "
      f"than its function ({_types(out)} as traced, {_types(out_d)} under jax.grad); the loss "
      f"tags outside the rule ({'; '.join(beside)}) make K-FAC differentiate the traced graph, "
      "which JAX cannot do for such a call. Make the rule return the function's outputs, or "
      "move the tags into the rule or into `curvature_fn=`."
    )


def _only_in(graph: _graph.FlatGraph, other: _graph.FlatGraph) -> list[str]:
  """The `tag_names` of `graph`'s loss tags `other` lacks (by kind, prediction and call stack)."""

  def sig(fe):
    where = _compat.source_frames(fe.eqn, _PACKAGE_DIR)
    return fe.params["kind"], str(_graph.aval_of(fe.ins[0])), where

  left = collections.Counter(sig(fe) for fe in other.eqns if fe.eqn.primitive is _tags.loss_tag_p)
  names, out = tag_names(graph), []
  for name, fe in zip(names, (fe for fe in graph.eqns if fe.eqn.primitive is _tags.loss_tag_p)):
    if left[sig(fe)]:
      left[sig(fe)] -= 1
    else:
      out.append(name)
  return out


class _Scanner:
  """Runs the matchers in order (first claim wins: manual tags, shared leaves, the passes)."""

  def __init__(self, ix: _index.GraphIndex, layer_config, strict, warn, collect):
    self.ix = ix
    self.layer_config = layer_config
    self.strict = strict
    self.warn = warn
    self.problems: list[str] | None = [] if collect else None

  def run(self) -> list[tuple[LayerSpec, Any, Any]]:
    """`(spec, output key(s), inputs)` per layer."""
    ix = self.ix
    specs: list[tuple[LayerSpec, Any, Any]] = []
    claimed: dict[int, str] = {v: "<a concatenation with other uses>" for v in ix.blocked_virtual}
    manual_dense: dict[int, list[Any]] = {}
    for fe in ix.g.eqns:
      if fe.eqn.primitive is _tags.layer_tag_p:
        specs.extend(self._manual(fe, claimed, manual_dense))
    specs.extend(self._manual_dense_layer(k, tags, claimed) for k, tags in manual_dense.items())
    for shifts in (False, True):
      for leaf in sorted(ix.uses):
        if leaf not in claimed and len(ix.uses[leaf]) > 1:
          match = _matchers_shared.match_shared(ix, leaf, claimed, shifts)
          if match is not None and not _without_batch_rows(ix, match):
            specs.append(self._accept(match, claimed))
    for matchers in _kinds.passes():
      for i in sorted(ix.uses_by_eqn):
        for _ in ix.uses_by_eqn[i]:  # At most once per leaf the equation uses.
          # A match without rows per example is left to the fallback, with its reason.
          found = (f(ix, i, claimed) for f in matchers)
          match = next((m for m in found if m is not None and not _without_batch_rows(ix, m)), None)
          if match is None:
            break
          specs.append(self._accept(match, claimed))
    specs = self._expand_virtual(specs, claimed)
    specs = _stacked.merge(ix, specs, claimed, self.claim)  # No virtual leaf is left after this.
    specs = self._link(specs, claimed)
    self._check_patterns(specs)
    return self._user_blocks(self._cover(specs, claimed))

  def _cover(self, specs, claimed):
    """`specs` and a generic layer per leftover leaf: a `LayerConfig.blocks` one or a fallback."""
    ix = self.ix
    for j in range(ix.n_params):
      if j not in claimed and self.layer_config.block_for((ix.paths[j],))[0] is not None:
        specs.append((self.layer_spec("generic", (j,), None, "diagonal", "config"), None, None))
        self.claim(claimed, (j,), ix.paths[j])
    uncovered = [j for j in range(ix.n_params) if j not in claimed]
    reasons = [fallback_reason(ix, j) for j in uncovered]
    if self.problems is not None:
      self.problems.extend(
        f"`{ix.paths[j]}` is not in any layer ({r}; it would get a diagonal fallback block)"
        for j, r in zip(uncovered, reasons)
      )
      if self.problems:
        raise RegistrationCheckError(self.problems)
    paths = [ix.paths[j] for j in uncovered]
    if uncovered and self.strict:
      message = uncovered_message(paths, reasons, len(uncovered))
      raise RegistrationError(message + " (strict=True turns this into an error.)")
    if uncovered and self.warn:
      warnings.warn(uncovered_message(paths, reasons), UncoveredParametersWarning, stacklevel=5)
    for j, reason in zip(uncovered, reasons):
      spec = self.layer_spec("generic", (j,), None, "diagonal", "fallback")
      specs.append((dataclasses.replace(spec, info=FallbackInfo(reason)), None, None))
    return specs

  def _user_blocks(self, specs):
    """Each layer a `LayerConfig.blocks` pattern matches, with the user's block."""
    used, out = set(), []
    for spec, outs, ins in specs:
      cls, pattern = self.layer_config.block_for((spec.name,) + tuple(spec.param_paths))
      if cls is not None:
        used.add(pattern)
        spec = with_block(spec, cls, f"block {cls.__name__} (LayerConfig.blocks[{pattern!r}])")
      out.append((spec, outs, ins))
    for pattern in self.layer_config.blocks:
      if pattern not in used:
        self._pattern_problem(
          f"LayerConfig.blocks: pattern {pattern!r} matches no layer name or parameter path, "
          f"or only layers an earlier pattern took ({self._some_paths()})"
        )
    if self.problems:
      raise RegistrationCheckError(self.problems)
    return out

  def _accept(self, match: _matchers.Match, claimed, approx=None, source="auto"):
    """`(spec, output key(s), inputs)` of a match, its leaves claimed."""
    spec, outs, ins = self._spec_of(match, approx, source)
    self.claim(claimed, match.leaves, spec.name)
    return spec, outs, ins

  def _spec_of(self, match: _matchers.Match, approx=None, source="auto"):
    """`(spec, output key(s), inputs)` of a match (keys and inputs per use if shared)."""
    kind, leaves = match.kind, list(match.leaves)
    if len(match.infos) > 1:
      infos = match.infos
      if kind == "dense" and len(self.ix.loss_roots) > 1:  # Which tag each use feeds.
        reached = [_index.tags_reached(self.ix, k) for k in match.outputs]
        infos = tuple(
          dataclasses.replace(inf, term=next(iter(r)) if len(r) == 1 else -1)
          for inf, r in zip(infos, reached)
        )
      return self._shared_spec(kind, leaves, infos, approx, source), match.outputs, match.inputs
    (info,), (out,), (ins,) = match.infos, match.outputs, match.inputs
    if not match.stack_size:
      return self.layer_spec(kind, leaves, info, approx, source), out, ins
    shapes = {j: self.ix.shapes[j][1:] for j in leaves}  # One layer of the stack.
    inner = self.layer_spec(kind, leaves, info, approx, source, shapes)
    return _stacked.stack_spec(self.ix, inner, leaves, match.stack_size, match.stack_axes), out, ins

  def _expand_virtual(self, specs, claimed):
    """Layers matched on concatenation leaves list the concatenated real leaves instead."""
    out = []
    for spec, outs, ins in specs:
      views = [self.ix.virtual.get(j) for j in spec.leaf_indices]
      if all(v is None for v in views):
        out.append((spec, outs, ins))
        continue
      leaves = [
        k for j, view in zip(spec.leaf_indices, views) for k in (view.leaves if view else (j,))
      ]
      paths = tuple(self.ix.paths[j] for j in leaves)
      name = common_prefix(paths)
      self.claim(claimed, [j for j in leaves if j not in spec.leaf_indices], name)
      whole = dataclasses.replace(
        spec,
        name=name,
        param_paths=paths,
        leaf_indices=tuple(leaves),
        param_shapes=tuple(self.ix.shapes[j] for j in leaves),
        concat=tuple(views),
        logical=spec,
      )
      out.append((sized(whole), outs, ins))
    return out

  def claim(self, claimed, leaves, name):
    for j in leaves:
      if j in claimed:
        self._problem(
          f"parameter `{self.ix.paths[j]}` is registered twice: in `{claimed[j]}` and in "
          f"`{name}`. Each parameter belongs to exactly one curvature block."
        )
      else:
        claimed[j] = name

  def _problem(self, msg: str) -> None:
    """A coverage problem: raised, or collected with `collect` (raised together at the end)."""
    if self.problems is None:
      raise RegistrationError(msg)
    self.problems.append(msg)

  def _pattern_problem(self, msg):
    self._problem(msg + "; fix the pattern (globs: `*` matches any characters, slashes included).")

  def _some_paths(self) -> str:
    n = self.ix.n_params
    return f"paths: {self.ix.paths[: min(8, n)]}{' ...' if n > 8 else ''}"

  def _check_patterns(self, specs):
    names = tuple(set(self.ix.paths) | {s[0].name for s in specs})
    for field in ("overrides", "block_sizes"):
      for pattern in getattr(self.layer_config, field):
        if not _layer_config.matches(pattern, names):
          self._pattern_problem(
            f"LayerConfig.{field}: pattern {pattern!r} matches no layer name or parameter "
            f"path ({self._some_paths()})"
          )

  def _link(self, specs, claimed):
    """Replaces the layers inside each `LayerConfig.linked` group by one generic block."""
    owner: dict[int, tuple[str, ...]] = {}
    paths = self.ix.paths
    for group, approx in self.layer_config.linked.items():
      leaves: list[int] = []
      for pattern in group:
        found = [j for j in range(self.ix.n_params) if _layer_config.matches(pattern, (paths[j],))]
        if not found:
          self._pattern_problem(
            f"LayerConfig.linked: pattern {pattern!r} of group {group} matches no parameter path"
          )
        leaves.extend(j for j in found if j not in leaves)
      for j in leaves:
        if j in owner:
          raise RegistrationError(
            f"LayerConfig.linked: parameter `{paths[j]}` is in two linked groups, "
            f"{owner[j]} and {group}; each parameter belongs to exactly one block."
          )
        owner[j] = group
      if not leaves:
        continue
      kept = []
      for s in specs:
        overlap = set(leaves).intersection(s[0].leaf_indices)
        if not overlap:
          kept.append(s)
          continue
        missing = [paths[j] for j in s[0].leaf_indices if j not in leaves]
        if missing:
          raise RegistrationError(
            f"LayerConfig.linked group {group} splits the {s[0].kind} layer `{s[0].name}`: it "
            f"holds {[paths[j] for j in sorted(overlap)]} but not {missing}; add them to the group."
          )
        for j in s[0].leaf_indices:
          claimed.pop(j, None)
      spec = self.layer_spec("generic", tuple(sorted(leaves)), None, approx, "linked")
      self.claim(claimed, sorted(leaves), spec.name)
      specs = kept + [(spec, None, None)]
    return specs

  def _manual(self, fe, claimed, manual_dense) -> list:
    """The layer of a manual tag, claimed; none for `register_dense`, kept in `manual_dense`."""
    record = _kinds.KINDS.get(fe.params["kind"])
    if record is None or record.read_tag is None:
      raise RegistrationError(f"a layer tag of unknown kind {fe.params['kind']!r}.")
    match = record.read_tag(self.ix, fe)
    kind = match.kind
    if kind == "dense":
      manual_dense.setdefault(match.leaves[0], []).append((match, fe.params["approx"]))
      return []
    spec, y, inputs = self._spec_of(match, fe.params["approx"], "manual")
    fix = "remove the tag (the scanner finds the shared layer) or use register_generic"
    for j in match.leaves if kind != "generic" else ():  # One tag registers one use.
      self.check_use_count(j, 1, f"register_{kind}", fix)
    self.claim(claimed, match.leaves, spec.name)
    return [(spec, y, inputs)]

  def _manual_dense_layer(self, k_leaf, tags, claimed):
    """One dense layer from the `register_dense` tags (match, approx) of kernel `k_leaf`."""
    uses = [m for m, _ in tags]
    leaves, approxes = uses[0].leaves, {a for _, a in tags}
    if any(m.leaves != leaves for m in uses) or len(approxes) > 1:
      raise RegistrationError(
        f"register_dense: kernel `{self.ix.paths[k_leaf]}` is registered {len(tags)} times with "
        "different biases or approximations "
        f"({[[self.ix.paths[j] for j in m.leaves] for m in uses]}, {sorted(map(str, approxes))}); "
        "register every use with the same bias and `approx`."
      )
    fix = "tag every use with the same `approx`, or remove the tags to let the scanner find them"
    self.check_use_count(k_leaf, len(tags), "register_dense", fix)
    infos = tuple(m.infos[0] for m in uses)
    outs, ins = tuple(m.outputs[0] for m in uses), tuple(m.inputs[0] for m in uses)
    match = _matchers.Match("dense", leaves, infos, outs, ins)
    return self._accept(match, claimed, tags[0][1], "manual")

  def check_use_count(self, leaf: int, registered: int, tag: str, fix: str) -> None:
    """A manual tag's use count against the graph's (unless the loss does not reach the leaf)."""
    graph_uses = len(self.ix.uses.get(leaf, []))
    if graph_uses and graph_uses != registered:
      self._problem(
        f"layer `{self.ix.paths[leaf]}` is used {graph_uses} times in loss_fn but registered "
        f"with {registered} {tag} tag(s); {fix}."
      )

  def _draft(self, kind, leaves, source, leaf_shapes=None, **fields) -> LayerSpec:
    """A LayerSpec over `leaves`, its approximation ("") and factor shapes still to be chosen."""
    shape_of = self.ix.shapes if leaf_shapes is None else leaf_shapes
    paths = tuple(self.ix.paths[j] for j in leaves)
    return LayerSpec(
      name=paths[0] if kind == "generic" and len(paths) == 1 else common_prefix(paths),
      kind=kind,
      param_paths=paths,
      leaf_indices=tuple(leaves),
      approx=cast("Approximation", ""),
      factor_shapes=(),
      source=source,
      param_shapes=tuple(shape_of[j] for j in leaves),
      **fields,
    )

  def _shared_spec(self, kind, leaves, infos, approx, source) -> LayerSpec:
    """The spec of a layer used `len(infos)` times. Its approximation: the tag's, else an
    `overrides` pattern's, else the kind's shared default after the size policy."""
    # A tied table's lookup, else a use that reads the kernel matrix as the layer does.
    info = next(
      (inf for inf in infos if isinstance(inf, EmbeddingInfo)),
      next(inf for inf in infos if not getattr(inf, "transposed", False)),
    )
    spec = self._draft(kind, leaves, source, info=info, num_uses=len(infos), use_infos=infos)
    paths, name = list(spec.param_paths), spec.name
    choices, pattern = _kinds.KINDS[kind].shared, None
    if approx is None:
      pattern, approx = _layer_config.first_match(self.layer_config.overrides, (name, *paths))
    explicit = approx is not None
    terms = {getattr(inf, "term", -1) for inf in infos}
    two_terms = len(terms) == 2 and -1 not in terms
    if approx is None and two_terms:  # Two loss terms: their Kronecker sum, inverted exactly.
      approx = "kron_terms"
    if approx == "kron_terms" and not two_terms:
      raise RegistrationError(
        f"approximation 'kron_terms' needs the uses of layer {paths} to feed exactly two loss "
        f'tags, one each; they feed {sorted(terms)} (-1: several). Use "kron_indep".'
      )
    if approx == "kron" and "kron_indep" in choices:
      approx = "kron_indep"
    if approx is not None and approx not in choices:
      raise _misfit(approx, spec, choices, pattern)
    if approx in _kinds.SERIES and any(getattr(inf, "transposed", False) for inf in infos):
      raise RegistrationError(
        f"approximation {approx!r} needs the uses of layer {paths} to read its kernel one way "
        'round, but some read it transposed (a reverse-mode derivative); use "kron_indep".'
      )
    if approx in _kinds.SERIES and (kind != "dense" or len({inf.rows for inf in infos}) != 1):
      raise RegistrationError(
        f"approximation {approx!r} needs the uses of layer {paths} to be dense products "
        f"with equal row counts (the steps of a recurrence); got {kind} uses with rows "
        f'{[getattr(inf, "rows", None) for inf in infos]}. Use "kron_indep".'
      )
    return self._finish(dataclasses.replace(spec, approx=approx or choices[0]), choices, explicit)

  def layer_spec(self, kind, leaves, info, approx, source, leaf_shapes=None) -> LayerSpec:
    """A single-use LayerSpec: an explicit manual or linked approximation, else the config's, else
    the default (then the size policy). `leaf_shapes`: one layer of a stack's."""
    spec = self._draft(kind, leaves, source, leaf_shapes, info=info)
    paths, name = spec.param_paths, spec.name
    builtin, note = _kinds.default_approx(kind, info)
    choices = _kinds.KINDS[kind].approximations
    explicit, pattern = approx is not None and source in ("manual", "linked"), None
    if explicit and approx in _kinds.SERIES:
      raise RegistrationError(
        f"approximation {approx!r} models successive uses of a shared layer, but the layer "
        f'with parameters {list(paths)} is used once; use "kron".'
      )
    if not explicit:
      pattern, chosen = _layer_config.first_match(self.layer_config.overrides, (name, *paths))
      if pattern is None:
        chosen = self.layer_config.defaults.get(kind, builtin if approx is None else approx)
      approx, explicit = chosen, pattern is not None
    if approx not in choices:
      raise _misfit(approx, spec, choices, pattern)
    spec = dataclasses.replace(spec, approx=approx, note=note if approx == builtin else "")
    return self._finish(spec, choices, explicit)

  def _finish(self, spec: LayerSpec, choices, explicit: bool) -> LayerSpec:
    """`spec` after the size policy (unless `explicit`), with its block size, sized."""
    if not explicit:
      max_dim, shapes = self.layer_config.max_factor_dim, _blocks.factor_shapes_for(spec)
      approx, why = _layer_config.size_policy(
        max_dim, spec.approx, shapes, choices, spec.has_bias, spec.num_uses
      )
      spec = dataclasses.replace(spec, approx=approx, note=why or spec.note)
    if spec.kind in ("dense", "conv", "embedding"):
      size = self.layer_config.block_size_for((spec.name,) + tuple(spec.param_paths))
      spec = dataclasses.replace(spec, block_size=size)
      note = "; ".join(n for n in (spec.note, _blocks.blocked_note(spec)) if n)
      spec = dataclasses.replace(spec, note=note)
    return sized(spec)


def _misfit(approx, spec: LayerSpec, choices, pattern: str | None) -> RegistrationError:
  """The error for an approximation (`LayerConfig.overrides[pattern]`'s if given) `spec` lacks."""
  where = "approximation" if pattern is None else f"LayerConfig.overrides[{pattern!r}] ="
  uses = f", which is used {spec.num_uses} times" if spec.num_uses > 1 else ""
  fix = "" if pattern is None else ", or narrow the pattern so that it misses this layer"
  return RegistrationError(
    f"{where} {approx!r} does not fit the {spec.kind} layer `{spec.name}` (parameters "
    f"{list(spec.param_paths)}){uses}; choose one of {choices}{fix}."
  )


def with_block(spec: LayerSpec, cls, note: str) -> LayerSpec:
  """`spec` (and the spec its wrapper computes with) computed by the user's block `cls`."""
  if spec.stack_inner is not None:
    spec = dataclasses.replace(spec, stack_inner=with_block(spec.stack_inner, cls, note))
  if spec.logical is not None:
    spec = dataclasses.replace(spec, logical=with_block(spec.logical, cls, note))
  shapes = cls.factor_shapes_for(spec.stack_inner or spec.logical or spec)
  if not (
    isinstance(shapes, tuple)
    and all(isinstance(s, tuple) and all(isinstance(d, int) for d in s) for s in shapes)
  ):
    raise RegistrationError(
      f"layer `{spec.name}`: {cls.__name__}.factor_shapes_for returns {shapes!r}; it must "
      "return a tuple of shapes (tuples of ints), one per factor."
    )
  return sized(dataclasses.replace(spec, block=cls, note=note))


def sized(spec: LayerSpec) -> LayerSpec:
  """`spec` with the factor shapes its block keeps (`blocks.factor_shapes_for`)."""
  return dataclasses.replace(spec, factor_shapes=_blocks.factor_shapes_for(spec))


def _without_batch_rows(ix: _index.GraphIndex, match: _matchers.Match) -> bool:
  """A `batch_rows` match whose first input is made of parameters and constants (no shared tap)."""
  return _kinds.KINDS[match.kind].batch_rows and any(
    ins and _graph.is_key(ins[0]) and ins[0] in ix.param_only and not getattr(inf, "shared_tap", 0)
    for ins, inf in zip(match.inputs, match.infos)
  )


# Why a parameter got a fallback block (the warning, `summary`, `check_registration`).


def _constant_operand(ix: _index.GraphIndex, atom) -> float | None:
  """The scalar value of `atom` if it is a constant (a literal, possibly broadcast), else None."""
  while _graph.is_key(atom) and atom in ix.producer:
    fe = ix.g.eqns[ix.producer[atom]]
    if fe.name not in _graph.VIEW_OPS:
      return None
    atom = fe.ins[0]
  val = _graph.constant_value(ix.const_values, atom)
  if val is None or not val.size or not np.all(val == val.reshape(-1)[0]):
    return None
  return float(val.reshape(-1)[0])


def _feeds_product(ix: _index.GraphIndex, key, depth: int = 4, within=None) -> bool:
  """Whether `key` reaches a `_PRODUCTS` equation within `depth` steps (through `within` keys)."""
  keep = lambda k: within is None or k in within
  found = _downstream(ix, [key] if keep(key) else [], depth, keep)
  return any(fe.name in _PRODUCTS for fe in found)


def _downstream(ix: _index.GraphIndex, keys, depth: int, keep):
  """The equations reading `keys`, then the outputs `keep` accepts, for `depth` levels (products'
  outputs not followed)."""
  seen = set(keys)
  for _ in range(depth):
    nxt: list[Any] = []
    for k in keys:
      for j, _ in ix.slice_consumers.get(k, []):
        fe = ix.g.eqns[j]
        yield fe
        if fe.name not in _PRODUCTS:
          nxt.extend(o for o in fe.outs if keep(o) and o not in seen)
          seen.update(fe.outs)
    keys = nxt


_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})
_NO_ROWS = (
  "an input computed from parameters and constants alone (no rows per example, e.g. latents "
  "projected, then multiplied with the batch's activations rather than broadcast over the batch)"
)
_GENERIC_FIX = (
  'tag it in loss_fn with `kfac_jax.register_generic(param, approx="full")` for a full block '
  "(the fallback is its diagonal)"
)
# Elementwise functions of one operand: a parameter passed through one is not read as itself.
_UNARY = frozenset(
  {"exp", "exp2", "log", "log1p", "expm1", "logistic", "tanh", "sqrt", "rsqrt", "sin", "cos"}
  | {"abs", "neg", "square", "integer_pow"}
)
_KERNEL_NGD = (
  "use the kernel natural gradient, `kfac_jax.kernel_ngd` (SR, ENGD-Woodbury or SPRING in "
  "sample space), which needs no layer structure"
)


def _no_rows(ix: _index.GraphIndex, fe, pos: int) -> bool:
  """Whether every other operand of `fe` (a key) is computed from parameters and constants."""
  others = [a for j, a in enumerate(fe.ins) if j != pos and _graph.is_key(a)]
  return bool(others) and all(a in ix.param_only for a in others)


def _ops_before_product(ix: _index.GraphIndex, leaf: int, limit: int = 4) -> list[str]:
  """The first `limit` primitives from `leaf` to the products its parameter-only values reach."""
  keys = [k for k, (j, _) in ix.origin.items() if j == leaf]
  found = _downstream(ix, keys, 12, lambda k: k in ix.param_only)
  skip = _PRODUCTS | _graph.VIEW_OPS
  names = list(dict.fromkeys(fe.name for fe in found if fe.name not in skip))
  return names[:limit] + (["..."] if len(names) > limit else [])


def _scale_shift_reason(ix: _index.GraphIndex, fe, pos: int) -> str:
  """Why `mul` / `add` of a parameter and an activation matched no scale and shift."""
  name, atom = fe.name, fe.ins[pos]
  out_shape = _graph.shape_of(fe.outs[0])
  leaf, chain = ix.origin[atom]
  block = _matchers.feature_block(ix.shapes[leaf], chain, _graph.shape_of(atom), out_shape)
  if block is None or len(block[1]) == len(out_shape):
    return (
      f"consumed by {name} in a layout no scale-and-shift matcher fits (it does not span "
      f"consecutive axes of the output {out_shape}, broadcast along the others)"
    )
  return (
    f"consumed by {name} on rows that are not examples: no axis of the output {out_shape} "
    f"outside the parameter's {block[1]} has the batch's size {ix.batch_size} or was followed "
    "from the batch inputs, and no batch input has its leading axis; " + _GENERIC_FIX
  )


def _use_reason(ix: _index.GraphIndex, leaf: int, i: int, pos: int) -> str:
  """Why one use (equation `i`, operand `pos`) of `leaf` matched no layer."""
  fe = ix.g.eqns[i]
  name, x, chain = fe.name, fe.ins[0], ix.origin[fe.ins[pos]][1]
  if name == "scan_slice":
    return "sliced by a scan (a stacked layer axis)"
  others = [leaf_ for leaf_, _ in ix.uses_by_eqn.get(i, []) if leaf_ != leaf]
  if name == "dot_general" and pos == 0 and others and _graph.is_key(x) and x in ix.param_only:
    return (
      f"the input of `{ix.paths[others[0]]}` with no rows per example (a learned probe "
      "projected before it is broadcast over the batch: broadcast it first)"
    )
  if name in ("gather", "dot_general", "conv_general_dilated") and _no_rows(ix, fe, pos):
    return f"consumed by {name} with {_NO_ROWS}"
  if any(s.op == "gather" for s in chain):
    return f"gathered at constant positions, then consumed by {name} (no matcher)"
  if name in ("slice", "dynamic_slice", "gather", "dynamic_update_slice"):
    return f"indexed by {name} before use (e.g. one slice of a stacked array)"
  if name == "concatenate":
    matmul = _feeds_product(ix, fe.outs[0])
    return "concatenated before a matmul" if matmul else "concatenated with other arrays before use"
  if name in ("add", "sub") and (c := _constant_operand(ix, fe.ins[1 - pos])) is not None:
    if name == "add":
      return f"used as {c:g} + scale"
    return f"used as {c:g} - scale" if pos == 1 else f"used as scale - {c:g}"
  if others:
    return (
      f"combined by {name} with parameter `{ix.paths[others[0]]}` (a product or sum of "
      "two parameters has no layer block)"
    )
  # An operand computed from parameters alone (weight normalisation's `v / |v| · g`).
  if name not in _PRODUCTS and _feeds_product(ix, fe.outs[0], 10, ix.param_only):
    return (
      f"transformed by {', '.join(_ops_before_product(ix, leaf))} into a matmul operand "
      "computed from parameters and constants alone (e.g. a standardised, weight-normalised "
      "or masked kernel, or latents before they are broadcast over the batch): no layer block "
      f"fits; {_GENERIC_FIX}"
    )
  if name in _UNARY:
    return (
      f"passed through {name} before use (a reparameterised parameter, e.g. `x * "
      f"exp(log_scale)`): the layer blocks read the parameter itself; {_GENERIC_FIX}"
    )
  if name in ("mul", "add") and _no_rows(ix, fe, pos):
    return f"consumed by {name} with {_NO_ROWS}"
  if name == "dot_general":
    (_, _), (lhs_b, rhs_b) = fe.params["dimension_numbers"]
    if lhs_b or rhs_b:
      return "consumed by a batched dot_general (batch dimensions, e.g. per-head weights)"
    if any(s.op == "broadcast" for s in chain):
      return "broadcast before a matmul"
    return "consumed by dot_general in a layout no dense matcher fits"
  if name in ("mul", "add"):
    return _scale_shift_reason(ix, fe, pos)
  if name == "conv_general_dilated":
    return "consumed by conv_general_dilated in a form no conv matcher fits"
  return f"consumed by {name} (no matcher)"


def _derivative_reason(ix: _index.GraphIndex, leaf: int, uses) -> str:
  """Why a kernel read by derivatives of the model (products by it or its transpose, inputs
  constant over the examples tapped by `_matchers.hoisted_tap`) matched no layer, or ""."""
  dense = [
    (i, d)
    for i, pos in uses
    if ix.g.eqns[i].name == "dot_general" and (d := _matchers.dense_use(ix, i, pos)) is not None
  ]
  lost = [
    (i, x)
    for i, (info, x, _, _) in dense
    if _graph.is_key(x)
    and x in ix.param_only
    and _matchers.constant_input_tap(ix, ix.g.eqns[i].outs[0], info) is None
  ]
  if lost and (len(lost) < len(uses) or all(_from_constants(ix, x) for _, x in lost)):
    return (
      f"{len(lost)} of its {len(uses)} uses multiply an input that is one constant for every "
      "point (a direction or reverse-mode seed under `jax.vmap`), and the product reaches the "
      "points through more than layout changes and elementwise broadcasting, so it has no "
      "output gradient per point: compute the operator on the batched points, the direction "
      "broadcast over them (`jax.jvp(f, (x,), (jnp.broadcast_to(e, x.shape),))`), or " + _KERNEL_NGD
    )
  if len(ix.shapes[leaf]) == 2 and len(dense) > 1:
    mats = [kernel_index_matrix(d[0], ix.shapes[leaf]) for _, d in dense]
    if any(np.array_equal(m.T, m2) and not np.array_equal(m, m2) for m in mats for m2 in mats):
      return (
        "read both ways round, as a reverse-mode derivative inside the loss does, but not only "
        "as the kernel matrix and its transpose (`δa = δz Wᵀ`): no Kronecker block fits; "
        f"{_KERNEL_NGD}, or {_GENERIC_FIX}"
      )
  names = {ix.g.eqns[i].name for i, _ in uses}
  if "rev" in names and names & _PRODUCTS:
    return (
      "read flipped (`rev`) besides its products, as a convolution's reverse-mode derivative "
      f"reads its kernel: no Kronecker block fits; {_KERNEL_NGD}"
    )
  return ""


def _from_constants(ix: _index.GraphIndex, atom) -> bool:
  """Whether `atom` is computed from constants alone (no parameter, no batch input)."""
  params = set(ix.g.invars[: ix.n_params])
  seen, todo = set(), [atom]
  while todo:
    a = todo.pop()
    if not _graph.is_key(a) or a in seen:
      continue
    seen.add(a)
    if a in params or a in ix.from_batch:
      return False
    todo.extend(ix.g.eqns[ix.producer[a]].ins if a in ix.producer else ())
  return True


def fallback_reason(ix: _index.GraphIndex, leaf: int) -> str:
  """Why the scanner matched no layer for `leaf`: one short phrase (e.g. "used as 1 + scale")."""
  uses: Sequence[Any] = ix.uses.get(leaf, ())
  if not uses:
    keys = {k for k, (j, _) in ix.origin.items() if j == leaf}
    if any(_graph.is_key(a) and a in keys for fe in ix.g.eqns for a in fe.ins):
      return "not used by the loss (only outside the loss tags' inputs, e.g. a regulariser)"
    return "not used by the loss"
  if not any(i in ix.grad_slice for i, _ in uses):
    return (
      "reaches the loss tags only through stop_gradient (no curvature from them; e.g. a "
      "VQ-VAE codebook trained by an untagged term)"
    )
  if derivative := _derivative_reason(ix, leaf, uses):
    return derivative
  reasons = [_use_reason(ix, leaf, i, pos) for i, pos in uses]
  first = ("sliced by a scan", "indexed by", "transformed by")
  found = next((r for r in reasons if r.startswith(first)), None)
  if found is not None or len(uses) == 1:
    return found or reasons[0]
  names = tuple(dict.fromkeys(ix.g.eqns[i].name for i, _ in uses))
  if len(set(reasons)) == 1 and not reasons[0].startswith("consumed by"):
    return f"{reasons[0]} (all {len(uses)} uses)"
  if len(names) == 1 and names[0] in ("dot_general", "conv_general_dilated", "mul", "add"):
    return (
      f"used {len(uses)} times by {names[0]} in ways no one shared layer fits (e.g. "
      "different kernel layouts, or biases that differ between uses)"
    )
  return f"used {len(uses)} times in different ways ({', '.join(names)})"


def uncovered_message(paths: Sequence[str], reasons: Sequence[str], limit: int = 3) -> str:
  """The short `UncoveredParametersWarning` text: the count, a few paths with reasons, a pointer."""
  shown = "; ".join(f"`{p}` ({r})" for p, r in list(zip(paths, reasons))[:limit])
  more = f"; and {len(paths) - limit} more" if len(paths) > limit else ""
  return (
    f"{len(paths)} parameter(s) are not in any recognised layer and get a diagonal "
    f"curvature block: {shown}{more}. `kfac_jax.summary(loss_fn, params, batch)` lists "
    "each with its reason; a manual layer tag (kfac_jax.register_dense, ...) chooses its block."
  )

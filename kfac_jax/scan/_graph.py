"""A flat view of a traced function: transformations inlined, one equation list.

The scanner matches layers on this list and the curvature pass evaluates it with taps (a zero
perturbation added to each layer output, the layer inputs recorded). Seen through:

  * nested `jit` / `pjit` / `closed_call`: inlined.
  * remat (`jax.checkpoint`, `nn.remat`, `nnx.remat`) and `custom_jvp` / `custom_vjp` calls that
    read a parameter (or a view of one): inlined. A remat call's equations are a `Region`, run
    again under `jax.checkpoint` with the original policy, so the program still rematerialises.
    A custom-derivative call's equations are a `CustomCall`: evaluated as the user's call itself
    when nothing inside is tapped or watched, and otherwise so that the call's outputs keep the
    user's derivative in its inputs while the perturbations inside are differentiated through
    the primal function (`FlatGraph._evaluate_custom`). The gradient is always `jax.grad`'s.
  * `lax.scan` whose operands depend on the parameters: unrolled into T copies of the body, each
    step reading its carry and its `xs` slice through synthetic equations (`scan_carry`,
    `scan_slice`) and the `ys` stacked by `scan_stack`. A parameter closed over by the body has
    T uses; a stacked one passed in `xs` is T slices. `evaluate` runs the steps again as one
    `lax.scan` (`ScanGroup`), so compile time does not grow with T.

Other higher-order primitives, and scans, remat or custom calls that read no parameter, stay
opaque equations. Values are keyed by `(instance, Var)`: each inlined call gets its own instance,
since JAX may reuse one inner jaxpr for several calls.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _compat

Key = tuple[int, Any]  # (instance, Var)
Atom = Any  # Key or _compat.Literal


@dataclasses.dataclass(frozen=True, eq=False)
class FlatEqn:
  """One equation. Synthetic ones (from unrolling a scan) carry `fn` and a stand-in `eqn`."""

  eqn: Any
  ins: tuple[Atom, ...]
  outs: tuple[Key, ...]
  fn: Callable[..., list[Any]] | None = None

  @property
  def name(self) -> str:
    return self.eqn.primitive.name

  @property
  def params(self) -> Mapping[str, Any]:
    return self.eqn.params


class _SynthVar:
  """A variable created while unrolling a scan (compared by identity, like jax's Var)."""

  def __init__(self, aval):
    self.aval = aval

  def __repr__(self):
    return f"synth{self.aval.str_short()}"


@dataclasses.dataclass(frozen=True)
class _SynthPrimitive:
  name: str


@dataclasses.dataclass(frozen=True)
class _SynthEqn:
  primitive: _SynthPrimitive
  params: Mapping[str, Any]


_SCAN_SLICE = _SynthPrimitive("scan_slice")
_SCAN_CARRY = _SynthPrimitive("scan_carry")
_SCAN_STACK = _SynthPrimitive("scan_stack")
# A custom call's output that repeats another (`return loss, Aux(energy=loss)`): its own key.
_OUTPUT_COPY = _SynthPrimitive("copy")


def is_key(atom: Atom) -> bool:
  return isinstance(atom, tuple)


@dataclasses.dataclass(frozen=True)
class HoistedTap:
  """The tap of a layer output computed once for every example: a product `jax.vmap` hoisted
  out of the batch (a tangent direction of `jax.jvp` or `jax.jacfwd`, or a reverse-mode seed,
  is one constant for every point).

  The value reaches the batched computation through layout operations only, at `keys`, each
  read only by elementwise equations that broadcast it along their batch axis. The curvature
  pass adds to each key a zero perturbation of shape `shapes[j]` (the key's shape, its axis
  `axes[j]` the batch's), so that each example reads a copy of its own; `per_example` joins
  the perturbations' cotangents into the output gradients `[S, N, entries]`, one example's
  entries in order (`DenseInfo.shared_tap` says which entry of the product each is).
  """

  keys: tuple[Key, ...]
  axes: tuple[int, ...]
  shapes: tuple[tuple[int, ...], ...]

  def zeros(self) -> tuple[jax.Array, ...]:
    """The zero perturbations, one per key, in its dtype."""
    return tuple(jnp.zeros(s, k[1].aval.dtype) for k, s in zip(self.keys, self.shapes))

  def per_example(self, cts: Sequence[jax.Array]) -> jax.Array:
    """`[S, N, entries]` from the perturbations' cotangents (`[S, *shapes[j]]` each)."""
    return jnp.concatenate(
      [
        jnp.moveaxis(c, a + 1, 1).reshape(c.shape[0], c.shape[a + 1], -1)
        for c, a in zip(cts, self.axes)
      ],
      axis=-1,
    )


def constant_value(const_values: Mapping[Any, Any], atom):
  """The value of a literal or closed-over constant (`const_values`: key -> value) as a numpy
  array; None otherwise (also for a constant that is a tracer, e.g. closed over inside an outer
  `jit`)."""
  if isinstance(atom, _compat.Literal):
    value = atom.val
  elif is_key(atom) and atom in const_values:
    value = const_values[atom]
  else:
    return None
  try:
    return np.asarray(value)
  except jax.errors.JAXTypeError:  # A tracer.
    return None


def aval_of(atom: Atom):
  return atom.aval if isinstance(atom, _compat.Literal) else atom[1].aval


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
  """Equations `eqns[start:stop]` inlined from one (outermost) remat call.

  Attributes:
    start, stop: the equation range.
    options: the `jax.checkpoint` keyword arguments (`policy`, `prevent_cse`).
    ins: the keys the range reads but does not compute (constants excluded).
    outs: the keys the range computes that later equations or the graph's outputs read.
  """

  start: int
  stop: int
  options: Mapping[str, Any]
  ins: tuple[Key, ...] = ()
  outs: tuple[Key, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class CustomCall:
  """Equations `eqns[start:stop]` inlined from one `custom_jvp` / `custom_vjp` call.

  Attributes:
    start, stop: the equation range.
    eqn: the call's own equation (bound as is to get the user's derivative).
    ins: the call's operands (outer atoms), which the inlined equations read directly.
    outs: the keys, computed in the range, that stand for the call's outputs.
  """

  start: int
  stop: int
  eqn: Any
  ins: tuple[Atom, ...]
  outs: tuple[Key, ...]

  @property
  def name(self) -> str:
    return call_name(self.eqn)


def call_name(eqn) -> str:
  """A custom-derivative call's function name (the primitive's name when JAX kept none)."""
  sub = eqn.params.get("call_jaxpr")
  info = getattr(getattr(sub, "jaxpr", None), "debug_info", None)
  return getattr(info, "func_name", None) or eqn.primitive.name


@dataclasses.dataclass(frozen=True, eq=False)
class ScanGroup:
  """The T unrolled steps of one scan, evaluated again as a `lax.scan` (see `evaluate`).

  Each step's equations are `[carry identities, xs slices, body...]`, the same sequence in every
  step (checked). Values are matched across steps by position: `keys[k][p]` is the p-th value
  computed in step k (execution order).

  Attributes:
    steps: `(start, stop)` per step, in execution order.
    ncar, nxs: numbers of carries and of scanned inputs.
    reverse: the scan's direction (step k has index T-1-k when reversed).
    keys: per step, the keys its equations compute, in order.
    carry_out: per step, the atoms the next step's carry identities read.
    xs: the scanned arrays (outer atoms) read by step 0's slices.
    outside: `(p, steps)`: position p's values of those steps are read after the steps (or are
      graph outputs), other than by the recognised stackings.
    stacks: `(equation index, position p)` of the stacking equations after the steps whose
      parts are exactly position p of every step: their result is the scan's stacked output.
    stop: the index after the group's last equation (the steps and their stacking equations).
  """

  steps: tuple[tuple[int, int], ...]
  ncar: int
  nxs: int
  reverse: bool
  keys: tuple[tuple[Key, ...], ...]
  carry_out: tuple[tuple[Atom, ...], ...]
  xs: tuple[Atom, ...]
  outside: tuple[tuple[int, tuple[int, ...]], ...]
  stacks: tuple[tuple[int, int], ...]
  stop: int


# Equations kept whatever reads their outputs: the loss and layer tags.
_ROOTS = frozenset({"kfac_loss_tag", "kfac_layer_tag"})
# Operations that only move, reshape or cast their first operand.
VIEW_OPS = frozenset(
  {"convert_element_type", "copy", "copy_p", "reshape", "transpose", "broadcast_in_dim", "squeeze"}
)
# Operations through which a value stays "a parameter" for deciding what to inline.
_PARAM_VIEW_OPS = VIEW_OPS | {"slice", "dynamic_slice", "expand_dims", "scan_slice"}


@dataclasses.dataclass(frozen=True, eq=False)
class FlatGraph:
  """The equations of a closed jaxpr with calls, remat and parameter scans inlined."""

  invars: tuple[Key, ...]
  outvars: tuple[Atom, ...]
  consts: tuple[tuple[Key, Any], ...]
  eqns: tuple[FlatEqn, ...]
  regions: tuple[Region, ...] = ()
  scans: tuple[ScanGroup, ...] = ()
  customs: tuple[CustomCall, ...] = ()

  @classmethod
  def from_closed_jaxpr(cls, closed: _compat.ClosedJaxpr, n_params: int = 0) -> FlatGraph:
    """Flattens `closed`; scans reading any of its first `n_params` inputs are unrolled."""
    instances = itertools.count()
    consts: list[tuple[Key, Any]] = []
    eqns: list[FlatEqn] = []
    invars = tuple((0, v) for v in closed.jaxpr.invars)
    dep: set[Key] = set(invars[:n_params])
    pview: set[Key] = set(dep)  # Parameters and their views (slices, casts, reshapes).
    regions: list[tuple[int, int, Mapping[str, Any]]] = []
    scans: list[tuple[tuple, int, int, bool, int, int]] = []  # As `_scan_group` reads them.
    customs: list[CustomCall] = []
    remat_depth = [0]

    def record(fe: FlatEqn) -> None:
      eqns.append(fe)
      if any(is_key(a) and a in dep for a in fe.ins):
        dep.update(fe.outs)
      if fe.name in _PARAM_VIEW_OPS and fe.ins and is_key(fe.ins[0]) and fe.ins[0] in pview:
        pview.update(fe.outs)

    def unroll_scan(eqn, ins, instance, alias):
      p = eqn.params
      nc, ncar, length = p["num_consts"], p["num_carry"], int(p["length"])
      carry, xs = list(ins[nc : nc + ncar]), ins[nc + ncar :]
      ys_steps: list[list[Atom]] = [None] * length  # type: ignore[list-item]
      steps = []  # Per step, in execution order: (start, stop, carry outs).
      for t in reversed(range(length)) if p["reverse"] else range(length):
        start = len(eqns)
        # Each step reads its carry through an identity (the scan's carry), then its `xs` slices.
        step_ins = []
        for c in carry:
          step_ins.append((instance, _SynthVar(aval_of(c))))
          record(FlatEqn(_SynthEqn(_SCAN_CARRY, {}), (c,), (step_ins[-1],), fn=_identity_fn))
        for x in xs:
          step_ins.append((instance, _SynthVar(aval_of(x).update(shape=aval_of(x).shape[1:]))))
          fn = functools.partial(_slice_fn, t)
          record(FlatEqn(_SynthEqn(_SCAN_SLICE, {"index": t}), (x,), (step_ins[-1],), fn=fn))
        outs = walk(p["jaxpr"], list(ins[:nc]) + step_ins)
        carry, ys_steps[t] = outs[:ncar], outs[ncar:]
        steps.append((start, len(eqns), tuple(carry)))
      alias.update(zip(eqn.outvars[:ncar], carry))
      stack_start = len(eqns)
      for n, v in enumerate(eqn.outvars[ncar:]):
        parts = tuple(ys_steps[t][n] for t in range(length))
        fn = functools.partial(_stack_fn, v.aval)
        record(FlatEqn(_SynthEqn(_SCAN_STACK, {"length": length}), parts, ((instance, v),), fn=fn))
      scans.append((tuple(steps), ncar, len(xs), bool(p["reverse"]), stack_start, len(eqns)))

    def walk(sub: _compat.ClosedJaxpr, ins) -> list[Atom]:
      """Inlines `sub` as a new instance reading `ins`; returns its outputs."""
      jaxpr, instance = sub.jaxpr, next(instances)
      alias: dict[Any, Atom] = dict(zip(jaxpr.invars, ins))

      def resolve(atom):
        return atom if isinstance(atom, _compat.Literal) else alias.get(atom, (instance, atom))

      consts.extend(((instance, v), c) for v, c in zip(jaxpr.constvars, sub.consts))
      for eqn in jaxpr.eqns:
        ins = tuple(resolve(a) for a in eqn.invars)
        if (
          eqn.primitive.name == "scan"
          and int(eqn.params["length"]) > 0
          and any(is_key(a) and a in dep for a in ins)
        ):
          unroll_scan(eqn, ins, instance, alias)
          continue
        inner, kind = _compat.call_jaxpr_of(eqn), "call"
        if inner is None:
          found = _compat.transparent_jaxpr_of(eqn)
          if found is not None and any(is_key(a) and a in pview for a in ins):
            inner, kind = found
        if inner is None:
          record(FlatEqn(eqn, ins, tuple((instance, v) for v in eqn.outvars)))
          continue
        start, sizes = len(eqns), (len(regions), len(scans), len(customs))
        remat_depth[0] += kind == "remat"
        outs = walk(inner, ins)
        remat_depth[0] -= kind == "remat"
        if kind == "custom":
          made = {k for fe in eqns[start:] for k in fe.outs}
          if not all(is_key(a) and a in made for a in outs):
            # An output the call passes through (an input, a constant): kept opaque, since
            # only values computed inside can carry the user's derivative.
            del eqns[start:], regions[sizes[0] :], scans[sizes[1] :], customs[sizes[2] :]
            record(FlatEqn(eqn, ins, tuple((instance, v) for v in eqn.outvars)))
            continue
          for n, k in enumerate(outs):
            if k in outs[:n]:  # The rule may give each of them another derivative.
              outs[n] = (instance, eqn.outvars[n])
              record(FlatEqn(_SynthEqn(_OUTPUT_COPY, {}), (k,), (outs[n],), fn=_identity_fn))
          customs.append(CustomCall(start, len(eqns), eqn, ins, tuple(outs)))
        alias.update(zip(eqn.outvars, outs))
        if kind == "remat" and not remat_depth[0] and len(eqns) > start:
          regions.append((start, len(eqns), _compat.remat_options(eqn)))
      return [resolve(a) for a in jaxpr.outvars]

    outvars = tuple(walk(closed, invars))
    const_keys = {k for k, _ in consts}
    groups = (_scan_group(*s, eqns, outvars, const_keys) for s in scans)
    return cls(
      invars,
      outvars,
      tuple(consts),
      tuple(eqns),
      _regions(regions, eqns, outvars, const_keys),
      tuple(g for g in groups if g is not None),
      tuple(customs),
    )

  def evaluate(
    self,
    args: Sequence[Any],
    perturb: Mapping[Key, Any] | None = None,
    watch: frozenset[Key] = frozenset(),
    *,
    unroll: bool = False,
  ) -> tuple[list[Any], dict[Key, Any]]:
    """Evaluates the graph on `args` (arrays or tracers), remat regions under `jax.checkpoint`
    and unrolled scans as one `lax.scan` each (module docstring).

    Args:
      args: one value per input variable.
      perturb: key → array added to the value that equation produces (the key must be in
        `watch`); used to add the curvature pass's zero perturbations. A tuple of keys for which
        `scan_stacked` holds maps to one stacked `[T, ...]` perturbation of those steps.
      watch: the keys to report; their final values (after the perturbation) are returned. A
        tuple of keys for which `scan_stacked` holds is reported as one stacked value.
      unroll: evaluate the unrolled steps instead of a `lax.scan` (for tests and debugging).

    Returns:
      The outputs, and the watched values.
    """
    env: dict[Key, Any] = dict(self.consts)
    if len(args) != len(self.invars):
      raise ValueError(f"expected {len(self.invars)} inputs, got {len(args)}")
    perturb = perturb or {}
    # A watched constant (a layer input closed over by the loss function) is reported as is.
    seen: dict[Key, Any] = {k: v for k, v in self.consts if k in watch}
    for k, v in zip(self.invars, args):
      if k in watch:
        v = v + perturb[k] if k in perturb else v
        seen[k] = v
      env[k] = v
    for lo, hi in self._live_ranges:
      self._run(lo, hi, env, seen, perturb, watch, unroll)
    return [_read_atom(a, env) for a in self.outvars], seen

  @functools.cached_property
  def _live_ranges(self) -> tuple[tuple[int, int], ...]:
    """The equation ranges `evaluate` runs: the top-level blocks (an equation, or a custom call,
    remat region or scan group whole) that the outputs, a tag or an effect need, consecutive
    ones merged. The rest is dead code (in a custom rule's trace, the rule's own call of its
    function, which only its tangent reads), which JAX must not be asked to differentiate."""
    spans = sorted(
      [(c.start, c.stop, c.ins) for c in self.customs]
      + [(r.start, r.stop, r.ins) for r in self.regions]
      + [(g.steps[0][0], g.stop, g.xs) for g in self.scans]
    )
    blocks: list[tuple[int, int, list]] = []  # (start, stop, the span inputs read whole)
    i = k = 0
    while i < len(self.eqns):
      stop = i + 1
      reads: list[Atom] = []
      while k < len(spans) and spans[k][0] < stop:  # Spans starting inside the block join it.
        stop = max(stop, spans[k][1])
        reads.extend(spans[k][2])
        k += 1
      blocks.append((i, stop, reads))
      i = stop
    needed = {a for a in self.outvars if is_key(a)}
    live: list[tuple[int, int]] = []
    for lo, hi, reads in reversed(blocks):
      eqns = self.eqns[lo:hi]
      if any(
        fe.name in _ROOTS
        or (fe.fn is None and _compat.has_effects(fe.eqn))
        or any(k in needed for k in fe.outs)
        for fe in eqns
      ):
        needed.update(a for fe in eqns for a in fe.ins if is_key(a))
        needed.update(a for a in reads if is_key(a))
        if live and live[-1][0] == hi:
          live[-1] = (lo, live[-1][1])
        else:
          live.append((lo, hi))
    return tuple(reversed(live))

  @functools.cached_property
  def scan_positions(self) -> dict[Key, tuple[int, int, int]]:
    """Key → (scan group, step, position) for every value computed in a group's steps."""
    out = {}
    for n, grp in enumerate(self.scans):
      for k, keys in enumerate(grp.keys):
        for p, key in enumerate(keys):
          out[key] = (n, k, p)
    return out

  def scan_stacked(self, keys: Sequence[Atom]) -> bool:
    """Whether `keys` are one position of every step of one scan, in execution order: then the
    tuple can be watched and perturbed as one stacked `[T, ...]` value (see `evaluate`)."""
    found = [self.scan_positions.get(k) if is_key(k) else None for k in keys]
    if not found or any(f is None for f in found):
      return False
    n, _, p = cast(tuple[int, int, int], found[0])  # not None: checked above
    return len(found) == len(self.scans[n].keys) and all(
      f == (n, k, p) for k, f in enumerate(found)
    )

  @functools.cached_property
  def _customs_at(self) -> dict[int, tuple[CustomCall, ...]]:
    """Start index → the custom calls starting there, outermost first."""
    out: dict[int, list[CustomCall]] = {}
    for c in self.customs:
      out.setdefault(c.start, []).append(c)
    return {i: tuple(sorted(cs, key=lambda c: -c.stop)) for i, cs in out.items()}

  def _run(self, lo, hi, env, seen, perturb, watch, unroll=False, inside=frozenset()) -> None:
    """Evaluates `eqns[lo:hi]`, reading and writing `env` (a dict or ChainMap); `inside`: the
    remat regions and custom calls being evaluated (not entered again)."""
    regions = {r.start: r for r in self.regions}
    scans = {} if unroll else {g.steps[0][0]: g for g in self.scans}
    i = lo
    while i < hi:
      r = regions.get(i)
      c = next((c for c in self._customs_at.get(i, ()) if c not in inside), None)
      if c is not None and (r is None or r in inside or c.stop >= r.stop):
        self._evaluate_custom(c, env, seen, perturb, watch, unroll, inside)
        i = c.stop
        continue
      if r is not None and r not in inside:
        self._evaluate_region(r, env, seen, perturb, watch, unroll, inside)
        i = r.stop
        continue
      if i in scans:
        i = self._evaluate_scan(scans[i], env, seen, perturb, watch)
        continue
      fe = self.eqns[i]
      vals = [_read_atom(a, env) for a in fe.ins]
      outs = fe.fn(*vals) if fe.fn is not None else _compat.bind_eqn(fe.eqn, vals)
      for k, v in zip(fe.outs, outs):
        if k in watch:
          v = v + perturb[k] if k in perturb else v
          seen[k] = v
        env[k] = v
      i += 1

  def _evaluate_custom(self, c: CustomCall, env, seen, perturb, watch, unroll, inside) -> None:
    """Evaluates a custom-derivative call so that its gradient is the user's.

    Nothing inside watched: the call is bound as it is. Otherwise its outputs are
    `user(x) + (f(sg(x), ε) − sg(f(sg(x), ε)))`, `f` the inlined primal with the perturbations ε
    inside and `sg` stop_gradient: the value and the derivative in `x` are the user's rule's,
    the derivative in ε the primal's (the rule says nothing about values inside the call).
    Watched values inside (layer inputs, tagged predictions) come from `f(x, ε)`. The call's
    forward computation is thus traced three times; under jit XLA merges the copies (the
    compiled pass of a tapped dense layer inside a custom_jvp or custom_vjp has the plain
    layer's dot products), so they are not worth a bespoke evaluation.
    """
    ins = [_read_atom(a, env) for a in c.ins]
    user = _compat.bind_eqn(c.eqn, ins)
    made = [k for fe in self.eqns[c.start : c.stop] for k in fe.outs]
    if any(k in watch for k in made):
      keys = [a for a in c.ins if is_key(a)]
      inner = inside | {c}

      def primal(stop: bool, seen_here):
        vals = {k: jax.lax.stop_gradient(env[k]) if stop else env[k] for k in keys}
        local = collections.ChainMap({}, vals, env)
        self._run(c.start, c.stop, local, seen_here, perturb, watch, unroll, inner)
        return [local[k] for k in c.outs]

      primal(False, seen)
      held = primal(True, {})
      user = [
        u + (h - jax.lax.stop_gradient(h)) if jnp.issubdtype(jnp.result_type(u), jnp.inexact) else u
        for u, h in zip(user, held)
      ]
    for k, v in zip(c.outs, user):
      env[k] = v
      if k in watch:
        seen[k] = v

  def _evaluate_region(
    self, r: Region, env, seen, perturb, watch, unroll=False, inside=frozenset()
  ) -> None:
    """Evaluates `eqns[r.start:r.stop]` under `jax.checkpoint` with the region's options.

    The closure's inputs are the values the region reads; its outputs are the values read after
    it and the watched values it makes (after their perturbation), so taps inside a
    rematerialised block work and only what they record is kept beyond the block's own inputs.
    """
    made = [k for fe in self.eqns[r.start : r.stop] for k in fe.outs]
    watched = [k for k in made if k in watch]
    out_keys = list(dict.fromkeys(list(r.outs) + watched))

    def body(*in_vals):
      local = collections.ChainMap(dict(zip(r.ins, in_vals)), env)
      self._run(r.start, r.stop, local, {}, perturb, watch, unroll, inside | {r})
      return [local[k] for k in out_keys]

    vals = jax.checkpoint(body, **r.options)(*[env[k] for k in r.ins])
    for k, v in zip(out_keys, vals):
      env[k] = v
      if k in watch:
        seen[k] = v

  def _evaluate_scan(self, grp: ScanGroup, env, seen, perturb, watch) -> int:
    """Evaluates an unrolled scan's steps as one `lax.scan`; returns the index after them."""
    (s0, e0), nsteps = grp.steps[0], len(grp.steps)
    keys0 = grp.keys[0]
    pos = range(len(keys0))
    # Positions to perturb / watch in some step, and those read after the steps.
    pos0 = {key: p for p, key in enumerate(keys0)}
    column = lambda p: tuple(grp.keys[k][p] for k in range(nsteps))

    def stacked_pos(t) -> int | None:  # The position whose keys in every step are the tuple `t`.
      return pos0[t[0]] if _is_key_tuple(t) and t[0] in pos0 and column(pos0[t[0]]) == t else None

    tuple_eps = {p: v for t, v in perturb.items() if (p := stacked_pos(t)) is not None}
    tuple_watch = {p: t for t in watch if (p := stacked_pos(t)) is not None}
    eps_pos = [p for p in pos if p in tuple_eps or any(k in perturb for k in column(p))]
    watch_pos = [p for p in pos if p in tuple_watch or any(k in watch for k in column(p))]
    final = {}  # Position → carry index, for values needed only from the last step's carry.
    for p, needed in grp.outside:
      if needed == (nsteps - 1,) and keys0[p] in grp.carry_out[0]:
        final[p] = grp.carry_out[0].index(keys0[p])
    ys_pos = sorted(
      set(watch_pos) | {p for p, _ in grp.outside if p not in final} | {p for _, p in grp.stacks}
    )
    watch0 = frozenset(keys0[p] for p in watch_pos)
    carry_avals = [keys0[j][1].aval for j in range(grp.ncar)]
    carry_in = [
      _as_aval(_read_atom(self.eqns[s0 + j].ins[0], env), a) for j, a in enumerate(carry_avals)
    ]
    xs = [_read_atom(a, env) for a in grp.xs]
    if grp.reverse:
      xs = [x[::-1] for x in xs]
    zero = lambda k: jnp.zeros(k[1].aval.shape, k[1].aval.dtype)
    eps = [
      tuple_eps[p]
      if p in tuple_eps
      else jnp.stack([perturb[k] if k in perturb else zero(k) for k in column(p)])
      for p in eps_pos
    ]
    body_lo = s0 + grp.ncar + grp.nxs

    def body(carry, step_in):
      x_t, eps_t = step_in
      local = collections.ChainMap({}, env)
      for j, v in enumerate(carry):
        local[keys0[j]] = v
      for j, v in enumerate(x_t):
        local[keys0[grp.ncar + j]] = v
      local_perturb = {keys0[p]: e for p, e in zip(eps_pos, eps_t)}
      self._run(body_lo, e0, local, {}, local_perturb, watch0)
      new_carry = [
        _as_aval(_read_atom(a, local), av) for a, av in zip(grp.carry_out[0], carry_avals)
      ]
      return new_carry, [local[keys0[p]] for p in ys_pos]

    carry, ys = jax.lax.scan(body, carry_in, (xs, eps), length=nsteps)
    ys = dict(zip(ys_pos, ys))
    for p, j in final.items():
      env[grp.keys[-1][p]] = carry[j]
    for p, needed in grp.outside:
      if p in final:
        continue
      for k in needed:
        env[grp.keys[k][p]] = ys[p][k]
    for p, t in tuple_watch.items():
      seen[t] = ys[p]
    for p in watch_pos:
      for k, key in enumerate(column(p)):
        if key in watch:
          seen[key] = ys[p][k]
    for i, p in grp.stacks:
      stacked = ys[p][::-1] if grp.reverse else ys[p]
      env[self.eqns[i].outs[0]] = stacked.astype(self.eqns[i].outs[0][1].aval.dtype)
    # The stacking equations not recognised run as usual.
    done = {i for i, _ in grp.stacks}
    last = grp.steps[-1][1]
    for i in range(last, grp.stop):
      if i not in done:
        self._run(i, i + 1, env, seen, perturb, watch)
    return grp.stop


def _is_key_tuple(t) -> bool:
  return isinstance(t, tuple) and bool(t) and isinstance(t[0], tuple)


def _as_aval(x, aval):
  """`x` with exactly `aval`'s shape and dtype (not weakly typed): a scan carry's type."""
  x = jax.lax.convert_element_type(x, aval.dtype)
  return x if x.shape == aval.shape else jnp.broadcast_to(x, aval.shape)


def _read_atom(a, env):
  return a.val if isinstance(a, _compat.Literal) else env[a]


def _regions(ranges, eqns, outvars, const_keys) -> tuple[Region, ...]:
  """`Region`s with their input and output keys, from `(start, stop, options)` ranges."""
  last_read = {a: i for i, fe in enumerate(eqns) for a in fe.ins if is_key(a)}
  last_read.update((a, len(eqns)) for a in outvars if is_key(a))
  out = []
  for start, stop, options in ranges:
    made: set[Key] = set()
    ins: dict[Key, None] = {}
    outs: dict[Key, None] = {}
    for fe in eqns[start:stop]:
      for a in fe.ins:
        if is_key(a) and a not in made and a not in const_keys:
          ins[a] = None
      made.update(fe.outs)
      for k in fe.outs:
        if last_read.get(k, -1) >= stop:
          outs[k] = None
    out.append(Region(start, stop, options, tuple(ins), tuple(outs)))
  return tuple(out)


def _same_atom(a, b, const_keys) -> bool:
  if isinstance(a, _compat.Literal) or isinstance(b, _compat.Literal):
    return isinstance(a, _compat.Literal) and isinstance(b, _compat.Literal)
  # Constants of the body are keyed per step instance, with the same variable.
  return a == b or (a in const_keys and b in const_keys and a[1] is b[1])


def _scan_group(steps, ncar, nxs, reverse, stack_start, stop, eqns, outvars, const_keys):
  s0, e0, _ = steps[0]
  n = e0 - s0
  keys0 = [k for fe in eqns[s0:e0] for k in fe.outs]
  pos0 = {k: p for p, k in enumerate(keys0)}
  keys = []
  for s, e, _ in steps:
    if e - s != n:
      return None
    keys_k = [k for fe in eqns[s:e] for k in fe.outs]
    pos_k = {k: p for p, k in enumerate(keys_k)}
    for i in range(n):
      f0, fk = eqns[s0 + i], eqns[s + i]
      if len(f0.ins) != len(fk.ins) or len(f0.outs) != len(fk.outs):
        return None
      if (f0.fn is None) != (fk.fn is None) or (f0.fn is None and f0.eqn is not fk.eqn):
        return None
      if f0.fn is not None and f0.name != fk.name:
        return None
      for a0, ak in zip(f0.ins, fk.ins):
        if is_key(a0) and a0 in pos0:
          if not is_key(ak) or pos_k.get(ak) != pos0[a0]:
            return None
        elif i < ncar:  # A carry identity: reads the previous step's carry.
          continue
        elif not _same_atom(a0, ak, const_keys):
          return None
    keys.append(tuple(keys_k))
  carry_out = tuple(c for _, _, c in steps)
  for k in range(len(steps) - 1):  # Step k+1's carry identities read step k's carry outs.
    s_next = steps[k + 1][0]
    if tuple(eqns[s_next + j].ins[0] for j in range(ncar)) != tuple(carry_out[k]):
      return None
  for c in carry_out[0]:
    if is_key(c) and c not in pos0 and c not in const_keys:
      return None  # A carry out computed before the scan: kept unrolled (rare).
  stacks = []
  order = list(range(len(steps)))
  for i in range(stack_start, stop):
    parts = eqns[i].ins
    first = parts[order[-1] if reverse else 0] if parts else None
    p = pos0.get(first) if is_key(first) else None
    if p is None:
      continue
    want = [keys[k][p] for k in (reversed(order) if reverse else order)]
    if list(parts) == want:
      stacks.append((i, p))
  # Which step values are read after the steps, other than by the recognised stackings.
  stacked = {i for i, _ in stacks}
  readers: dict[Key, set[int]] = {}
  for i in range(steps[-1][1], len(eqns)):
    if i in stacked:
      continue
    for a in eqns[i].ins:
      if is_key(a):
        readers.setdefault(a, set()).add(i)
  for a in outvars:
    if is_key(a):
      readers.setdefault(a, set()).add(len(eqns))
  outside = []
  for p in range(len(keys0)):
    needed = tuple(k for k in order if keys[k][p] in readers)
    if needed:
      outside.append((p, needed))
  return ScanGroup(
    steps=tuple((s, e) for s, e, _ in steps),
    ncar=ncar,
    nxs=nxs,
    reverse=reverse,
    keys=tuple(keys),
    carry_out=carry_out,
    xs=tuple(eqns[s0 + ncar + j].ins[0] for j in range(nxs)),
    outside=tuple(outside),
    stacks=tuple(stacks),
    stop=stop,
  )


def _identity_fn(x):
  return [x]


def _slice_fn(t: int, x):
  return [x[t]]


def _stack_fn(aval, *parts):
  return [jnp.stack([jnp.broadcast_to(jnp.asarray(p, aval.dtype), aval.shape[1:]) for p in parts])]

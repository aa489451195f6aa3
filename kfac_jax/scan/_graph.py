"""A flat view of a traced function: calls inlined into one equation list.

The scanner matches layers on this list; the curvature pass evaluates it with taps. Inlined:
nested `jit` / `pjit` / `closed_call`; remat calls (a `Region`, evaluated again under
`jax.checkpoint`) and `custom_jvp` / `custom_vjp` calls (a `CustomCall`, evaluated with the
user's derivative) that read a parameter; a `lax.scan` reading the parameters, unrolled into T
steps (synthetic `scan_carry` / `scan_slice` / `scan_stack` equations) and evaluated again as one
`lax.scan` (`ScanGroup`). Anything else stays opaque. Values are keyed by `(instance, Var)`, one
instance per inlined call, since JAX may reuse one inner jaxpr for several calls.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _compat
from kfac_jax._specs import ViewStep

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


def _synth(name: str, **params) -> Any:
  """The stand-in `eqn` of a synthetic equation: its primitive's name and its params."""
  return types.SimpleNamespace(primitive=types.SimpleNamespace(name=name), params=params)


def is_key(atom: Atom) -> bool:
  return isinstance(atom, tuple)


@dataclasses.dataclass(frozen=True)
class HoistedTap:
  """The tap of a layer output computed once for all examples (hoisted by `jax.vmap`): a zero
  perturbation of shape `shapes[j]` (batch axis `axes[j]`) at each of the `keys` the batch reads."""

  keys: tuple[Key, ...]
  axes: tuple[int, ...]
  shapes: tuple[tuple[int, ...], ...]

  def zeros(self) -> tuple[jax.Array, ...]:
    """The zero perturbations, one per key, in its dtype."""
    return tuple(jnp.zeros(s, k[1].aval.dtype) for k, s in zip(self.keys, self.shapes))

  def per_example(self, cts: Sequence[jax.Array]) -> jax.Array:
    """`[S, N, entries]` from the perturbations' cotangents (`[S, *shapes[j]]` each)."""
    moved = [jnp.moveaxis(c, a + 1, 1) for c, a in zip(cts, self.axes)]
    return jnp.concatenate([c.reshape(c.shape[0], c.shape[1], -1) for c in moved], axis=-1)


def constant_value(const_values: Mapping[Any, Any], atom):
  """The numpy value of a literal or closed-over constant; None otherwise (or for a tracer)."""
  literal = isinstance(atom, _compat.Literal)
  if not literal and not (is_key(atom) and atom in const_values):
    return None
  try:
    return np.asarray(atom.val if literal else const_values[atom])
  except jax.errors.JAXTypeError:  # A tracer.
    return None


def aval_of(atom: Atom):
  return atom.aval if isinstance(atom, _compat.Literal) else atom[1].aval


def shape_of(atom: Atom) -> tuple[int, ...]:
  return tuple(aval_of(atom).shape)


def view_step(fe: FlatEqn) -> ViewStep:
  """The `ViewStep` of a `VIEW_OPS` equation or a `tile` of unit axes (a broadcast)."""
  in_shape, out_shape = shape_of(fe.ins[0]), shape_of(fe.outs[0])
  if fe.name == "tile":
    return ViewStep("broadcast", in_shape, out_shape, tuple(range(len(in_shape))))
  if fe.name == "transpose":
    return ViewStep("transpose", in_shape, out_shape, tuple(fe.params["permutation"]))
  if fe.name in ("reshape", "squeeze"):
    return ViewStep("reshape", in_shape, out_shape)
  if fe.name == "broadcast_in_dim":
    if math.prod(in_shape) == math.prod(out_shape):
      return ViewStep("reshape", in_shape, out_shape)  # Only inserts unit dimensions.
    return ViewStep("broadcast", in_shape, out_shape, tuple(fe.params["broadcast_dimensions"]))
  return ViewStep("cast", in_shape, out_shape)


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
  """Equations `eqns[start:stop]` inlined from one outermost remat call, its `jax.checkpoint`
  `options`, the keys it reads (`ins`, constants excluded) and those read after it (`outs`)."""

  start: int
  stop: int
  options: Mapping[str, Any]
  ins: tuple[Key, ...] = ()
  outs: tuple[Key, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class CustomCall:
  """Equations `eqns[start:stop]` inlined from one `custom_jvp` / `custom_vjp` call: its own
  equation `eqn`, its operands `ins` (outer atoms) and the keys standing for its outputs."""

  start: int
  stop: int
  eqn: Any
  ins: tuple[Atom, ...]
  outs: tuple[Key, ...]

  @property
  def name(self) -> str:
    """The function's name (the primitive's when JAX kept none)."""
    sub = self.eqn.params.get("call_jaxpr")
    info = getattr(getattr(sub, "jaxpr", None), "debug_info", None)
    return getattr(info, "func_name", None) or self.eqn.primitive.name


@dataclasses.dataclass(frozen=True, eq=False)
class ScanGroup:
  """The T alike unrolled steps of one scan, evaluated again as a `lax.scan`. `keys[k][p]`: the
  p-th value step k computes; `carry_out[k]`: step k+1's carry; `outside`: `(p, steps)` read after
  the steps but not by the `stacks` (`(equation, p)`); `stop`: the index after the stackings."""

  steps: tuple[tuple[int, int], ...]
  ncar: int
  reverse: bool
  keys: tuple[tuple[Key, ...], ...]
  carry_out: tuple[tuple[Atom, ...], ...]
  xs: tuple[Atom, ...]
  outside: tuple[tuple[int, tuple[int, ...]], ...]
  stacks: tuple[tuple[int, int], ...]
  stop: int


_IDENTITY = lambda x: [x]
# Equations kept whatever reads their outputs: the loss and layer tags.
_ROOTS = frozenset({"kfac_loss_tag", "kfac_layer_tag"})
# Operations that only move, reshape or cast their first operand.
VIEW_OPS = frozenset(
  {"convert_element_type", "copy", "copy_p", "reshape", "transpose", "broadcast_in_dim", "squeeze"}
)
# Operations through which a value stays "a parameter" for deciding what to inline.
_PARAM_VIEW_OPS = VIEW_OPS | {"slice", "dynamic_slice", "expand_dims", "scan_slice"}


class _Flattener:
  """The equations and inlined ranges recorded so far by one `FlatGraph.from_closed_jaxpr`."""

  def __init__(self, params: Sequence[Key]):
    self.instances = itertools.count()
    self.consts: list[tuple[Key, Any]] = []
    self.eqns: list[FlatEqn] = []
    self.dep: set[Key] = set(params)  # Keys computed from the parameters.
    self.pview: set[Key] = set(params)  # Parameters and their views (slices, casts, reshapes).
    self.regions: list[tuple[int, int, Mapping[str, Any]]] = []
    self.scans: list[tuple[tuple, int, int, bool, int, int]] = []  # As `_scan_group` reads them.
    self.customs: list[CustomCall] = []
    self.remat_depth = 0

  def record(self, fe: FlatEqn) -> None:
    self.eqns.append(fe)
    if any(is_key(a) and a in self.dep for a in fe.ins):
      self.dep.update(fe.outs)
    if fe.name in _PARAM_VIEW_OPS and fe.ins and is_key(fe.ins[0]) and fe.ins[0] in self.pview:
      self.pview.update(fe.outs)

  def unroll_scan(self, eqn, ins, instance, alias) -> None:
    p = eqn.params
    nc, ncar, length, reverse = p["num_consts"], p["num_carry"], int(p["length"]), p["reverse"]
    carry, xs = list(ins[nc : nc + ncar]), ins[nc + ncar :]
    ys_steps: list[list[Atom]] = [None] * length  # type: ignore[list-item]
    steps = []  # Per step, in execution order: (start, stop, carry outs).
    for t in reversed(range(length)) if reverse else range(length):
      start, step_ins = len(self.eqns), []
      for c in carry:  # Each step reads its carry through an identity, then its `xs` slices.
        step_ins.append((instance, _SynthVar(aval_of(c))))
        self.record(FlatEqn(_synth("scan_carry"), (c,), (step_ins[-1],), fn=_IDENTITY))
      for x in xs:
        step_ins.append((instance, _SynthVar(aval_of(x).update(shape=aval_of(x).shape[1:]))))
        fn = lambda v, t=t: [v[t]]
        self.record(FlatEqn(_synth("scan_slice", index=t), (x,), (step_ins[-1],), fn=fn))
      outs = self.walk(p["jaxpr"], list(ins[:nc]) + step_ins)
      carry, ys_steps[t] = outs[:ncar], outs[ncar:]
      steps.append((start, len(self.eqns), tuple(carry)))
    alias.update(zip(eqn.outvars[:ncar], carry))
    stack_start = len(self.eqns)
    for n, v in enumerate(eqn.outvars[ncar:]):
      parts = tuple(ys_steps[t][n] for t in range(length))
      fn = functools.partial(_stack_fn, v.aval)
      self.record(FlatEqn(_synth("scan_stack", length=length), parts, ((instance, v),), fn=fn))
    self.scans.append((tuple(steps), ncar, len(xs), bool(reverse), stack_start, len(self.eqns)))

  def walk(self, sub: _compat.ClosedJaxpr, ins) -> list[Atom]:
    """Inlines `sub` as a new instance reading `ins`; returns its outputs."""
    jaxpr, instance = sub.jaxpr, next(self.instances)
    alias: dict[Any, Atom] = dict(zip(jaxpr.invars, ins))

    def resolve(atom):
      return atom if isinstance(atom, _compat.Literal) else alias.get(atom, (instance, atom))

    self.consts.extend(((instance, v), c) for v, c in zip(jaxpr.constvars, sub.consts))
    for eqn in jaxpr.eqns:
      ins = tuple(resolve(a) for a in eqn.invars)
      opaque = FlatEqn(eqn, ins, tuple((instance, v) for v in eqn.outvars))
      reads_param = any(is_key(a) and a in self.dep for a in ins)
      if eqn.primitive.name == "scan" and int(eqn.params["length"]) > 0 and reads_param:
        self.unroll_scan(eqn, ins, instance, alias)
        continue
      inner, kind = _compat.call_jaxpr_of(eqn), "call"
      if inner is None:
        found = _compat.transparent_jaxpr_of(eqn)
        if found is not None and any(is_key(a) and a in self.pview for a in ins):
          inner, kind = found
      if inner is None:
        self.record(opaque)
        continue
      start, sizes = len(self.eqns), (len(self.regions), len(self.scans), len(self.customs))
      self.remat_depth += kind == "remat"
      outs = self.walk(inner, ins)
      self.remat_depth -= kind == "remat"
      if kind == "custom":
        made = {k for fe in self.eqns[start:] for k in fe.outs}
        if not all(is_key(a) and a in made for a in outs):
          # Only values computed inside can carry the user's derivative: kept opaque.
          del self.eqns[start:], self.regions[sizes[0] :], self.scans[sizes[1] :]
          del self.customs[sizes[2] :]
          self.record(opaque)
          continue
        for n, k in enumerate(outs):
          if k in outs[:n]:  # A repeated output gets its own key: the rule may differ for it.
            outs[n] = (instance, eqn.outvars[n])
            self.record(FlatEqn(_synth("copy"), (k,), (outs[n],), fn=_IDENTITY))
        self.customs.append(CustomCall(start, len(self.eqns), eqn, ins, tuple(outs)))
      alias.update(zip(eqn.outvars, outs))
      if kind == "remat" and not self.remat_depth and len(self.eqns) > start:
        self.regions.append((start, len(self.eqns), _compat.remat_options(eqn)))
    return [resolve(a) for a in jaxpr.outvars]


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
    invars = tuple((0, v) for v in closed.jaxpr.invars)
    f = _Flattener(invars[:n_params])
    outvars = tuple(f.walk(closed, invars))
    const_keys = {k for k, _ in f.consts}
    groups = (_scan_group(*s, f.eqns, outvars, const_keys) for s in f.scans)
    scans = tuple(g for g in groups if g is not None)
    regions = _regions(f.regions, f.eqns, outvars, const_keys)
    return cls(invars, outvars, tuple(f.consts), tuple(f.eqns), regions, scans, tuple(f.customs))

  def evaluate(
    self,
    args: Sequence[Any],
    perturb: Mapping[Key, Any] | None = None,
    watch: frozenset[Key] = frozenset(),
    *,
    unroll: bool = False,
  ) -> tuple[list[Any], dict[Key, Any]]:
    """Evaluates the graph on `args`, remat regions and unrolled scans as written.

    Args:
      args: one value (array or tracer) per input variable.
      perturb: key → array added to the value computed there (the key must be in `watch`); a
        `scan_stacked` tuple of keys maps to one stacked `[T, ...]` array.
      watch: the keys whose values (after the perturbation) are returned, a `scan_stacked`
        tuple as one stacked value.
      unroll: evaluate the unrolled steps instead of a `lax.scan` (for tests and debugging).

    Returns:
      The outputs, and the watched values.
    """
    if len(args) != len(self.invars):
      raise ValueError(f"expected {len(self.invars)} inputs, got {len(args)}")
    env: dict[Key, Any] = dict(self.consts)
    perturb = perturb or {}
    # A watched constant (a layer input closed over by the loss function) is reported as is.
    seen: dict[Key, Any] = {k: v for k, v in self.consts if k in watch}
    _store(self.invars, args, env, seen, watch, perturb)
    for lo, hi in self._live_ranges:
      self._run(lo, hi, env, seen, perturb, watch, unroll)
    return [_read_atom(a, env) for a in self.outvars], seen

  @functools.cached_property
  def _live_ranges(self) -> tuple[tuple[int, int], ...]:
    """The ranges `evaluate` runs: the top-level blocks (an equation, custom call, region or scan
    group) that the outputs, a tag or an effect need; the rest must not be differentiated."""
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
    """Whether `keys` are one position of every step of one scan, in order (one stacked value)."""
    first = self.scan_positions.get(keys[0]) if keys and is_key(keys[0]) else None
    if first is None:
      return False
    n, _, p = first
    return list(keys) == [step[p] for step in self.scans[n].keys]

  @functools.cached_property
  def _customs_at(self) -> dict[int, tuple[CustomCall, ...]]:
    """Start index → the custom calls starting there, outermost first."""
    out: dict[int, list[CustomCall]] = {}
    for c in self.customs:
      out.setdefault(c.start, []).append(c)
    return {i: tuple(sorted(cs, key=lambda c: -c.stop)) for i, cs in out.items()}

  def _run(self, lo, hi, env, seen, perturb, watch, unroll=False, inside=frozenset()) -> None:
    """Evaluates `eqns[lo:hi]` into `env` (`inside`: the regions and calls not entered again)."""
    regions = {r.start: r for r in self.regions}
    scans = {} if unroll else {g.steps[0][0]: g for g in self.scans}
    i = lo
    while i < hi:
      r = regions.get(i)
      c = next((c for c in self._customs_at.get(i, ()) if c not in inside), None)
      if c is not None and (r is None or r in inside or c.stop >= r.stop):
        self._evaluate_custom(c, env, seen, perturb, watch, unroll, inside)
        i = c.stop
      elif r is not None and r not in inside:
        self._evaluate_region(r, env, seen, perturb, watch, unroll, inside)
        i = r.stop
      elif i in scans:
        i = self._evaluate_scan(scans[i], env, seen, perturb, watch)
      else:
        fe = self.eqns[i]
        vals = [_read_atom(a, env) for a in fe.ins]
        outs = fe.fn(*vals) if fe.fn is not None else _compat.bind_eqn(fe.eqn, vals)
        _store(fe.outs, outs, env, seen, watch, perturb)
        i += 1

  def _evaluate_custom(self, c: CustomCall, env, seen, perturb, watch, unroll, inside) -> None:
    """Evaluates a custom call with the user's gradient: with something inside watched, its
    outputs are `user(x) + (f(sg(x), ε) − sg(f(sg(x), ε)))`, `f` the inlined primal with the
    perturbations ε, `sg` stop_gradient (value and derivative in `x` are the rule's, in ε the
    primal's); watched values come from `f(x, ε)`."""
    ins = [_read_atom(a, env) for a in c.ins]
    user = _compat.bind_eqn(c.eqn, ins)
    if any(k in watch for fe in self.eqns[c.start : c.stop] for k in fe.outs):
      keys = [a for a in c.ins if is_key(a)]

      def primal(stop: bool, seen_here):
        vals = {k: jax.lax.stop_gradient(env[k]) if stop else env[k] for k in keys}
        local = collections.ChainMap({}, vals, env)
        self._run(c.start, c.stop, local, seen_here, perturb, watch, unroll, inside | {c})
        return [local[k] for k in c.outs]

      primal(False, seen)
      held = primal(True, {})
      user = [
        u + (h - jax.lax.stop_gradient(h)) if jnp.issubdtype(jnp.result_type(u), jnp.inexact) else u
        for u, h in zip(user, held)
      ]
    _store(c.outs, user, env, seen, watch)

  def _evaluate_region(self, r: Region, env, seen, perturb, watch, unroll, inside) -> None:
    """Evaluates a remat region under `jax.checkpoint`, returning its read and watched values."""
    made = [k for fe in self.eqns[r.start : r.stop] for k in fe.outs]
    out_keys = list(dict.fromkeys(list(r.outs) + [k for k in made if k in watch]))

    def body(*in_vals):
      local = collections.ChainMap(dict(zip(r.ins, in_vals)), env)
      self._run(r.start, r.stop, local, {}, perturb, watch, unroll, inside | {r})
      return [local[k] for k in out_keys]

    vals = jax.checkpoint(body, **r.options)(*[env[k] for k in r.ins])
    _store(out_keys, vals, env, seen, watch)

  def _evaluate_scan(self, grp: ScanGroup, env, seen, perturb, watch) -> int:
    """Evaluates an unrolled scan's steps as one `lax.scan`; returns the index after them."""
    (s0, e0), nsteps, keys0 = grp.steps[0], len(grp.steps), grp.keys[0]
    pos0 = {key: p for p, key in enumerate(keys0)}
    column = lambda p: tuple(grp.keys[k][p] for k in range(nsteps))

    def stacked_pos(t) -> int | None:  # The position whose keys in every step are the tuple `t`.
      found = isinstance(t, tuple) and t and isinstance(t[0], tuple) and t[0] in pos0
      return pos0[t[0]] if found and column(pos0[t[0]]) == t else None

    tuple_eps = {p: v for t, v in perturb.items() if (p := stacked_pos(t)) is not None}
    tuple_watch = {p: t for t in watch if (p := stacked_pos(t)) is not None}
    pos = range(len(keys0))
    eps_pos = [p for p in pos if p in tuple_eps or any(k in perturb for k in column(p))]
    watch_pos = [p for p in pos if p in tuple_watch or any(k in watch for k in column(p))]
    final = {  # Position → carry index, for values needed only from the last step's carry.
      p: grp.carry_out[0].index(keys0[p])
      for p, needed in grp.outside
      if needed == (nsteps - 1,) and keys0[p] in grp.carry_out[0]
    }
    ys_pos = sorted(
      set(watch_pos) | {p for p, _ in grp.outside if p not in final} | {p for _, p in grp.stacks}
    )
    watch0 = frozenset(keys0[p] for p in watch_pos)
    carry_avals = [keys0[j][1].aval for j in range(grp.ncar)]
    carry_in = [
      _as_aval(_read_atom(self.eqns[s0 + j].ins[0], env), a) for j, a in enumerate(carry_avals)
    ]
    xs = [_read_atom(a, env) for a in grp.xs]
    xs = [x[::-1] for x in xs] if grp.reverse else xs
    zero = lambda k: jnp.zeros(shape_of(k), k[1].aval.dtype)
    eps = [
      tuple_eps[p]
      if p in tuple_eps
      else jnp.stack([perturb[k] if k in perturb else zero(k) for k in column(p)])
      for p in eps_pos
    ]

    def body(carry, step_in):
      x_t, eps_t = step_in
      local = collections.ChainMap(dict(zip(keys0, [*carry, *x_t])), env)
      local_perturb = {keys0[p]: e for p, e in zip(eps_pos, eps_t)}
      self._run(s0 + grp.ncar + len(grp.xs), e0, local, {}, local_perturb, watch0)
      new_carry = [
        _as_aval(_read_atom(a, local), av) for a, av in zip(grp.carry_out[0], carry_avals)
      ]
      return new_carry, [local[keys0[p]] for p in ys_pos]

    carry, ys = jax.lax.scan(body, carry_in, (xs, eps), length=nsteps)
    ys = dict(zip(ys_pos, ys))
    for p, j in final.items():
      env[grp.keys[-1][p]] = carry[j]
    for p, needed in grp.outside:
      for k in needed if p not in final else ():
        env[grp.keys[k][p]] = ys[p][k]
    for p, t in tuple_watch.items():
      seen[t] = ys[p]
    for p in watch_pos:
      seen.update((key, ys[p][k]) for k, key in enumerate(column(p)) if key in watch)
    for i, p in grp.stacks:
      stacked = ys[p][::-1] if grp.reverse else ys[p]
      env[self.eqns[i].outs[0]] = stacked.astype(self.eqns[i].outs[0][1].aval.dtype)
    done = {i for i, _ in grp.stacks}  # The stacking equations not recognised run as usual.
    for i in range(grp.steps[-1][1], grp.stop):
      if i not in done:
        self._run(i, i + 1, env, seen, perturb, watch)
    return grp.stop


def _store(keys, vals, env, seen, watch, perturb=None) -> None:
  """Writes `vals` at `keys` into `env`, perturbed (with `perturb`) and reported when watched."""
  for k, v in zip(keys, vals):
    if k in watch:
      v = v + perturb[k] if perturb is not None and k in perturb else v
      seen[k] = v
    env[k] = v


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
    made = [k for fe in eqns[start:stop] for k in fe.outs]
    skip = const_keys.union(made)
    ins = dict.fromkeys(a for fe in eqns[start:stop] for a in fe.ins if is_key(a) and a not in skip)
    outs = [k for k in made if last_read.get(k, -1) >= stop]
    out.append(Region(start, stop, options, tuple(ins), tuple(outs)))
  return tuple(out)


def _same_atom(a, b, const_keys) -> bool:
  if isinstance(a, _compat.Literal) or isinstance(b, _compat.Literal):
    return isinstance(a, _compat.Literal) and isinstance(b, _compat.Literal)
  # Constants of the body are keyed per step instance, with the same variable.
  return a == b or (a in const_keys and b in const_keys and a[1] is b[1])


def _same_step(eqns, s0, s, n, ncar, pos0, pos_k, const_keys) -> bool:
  """Whether the n equations from `s` repeat those from `s0` (step 0), position by position."""
  for i in range(n):
    f0, fk = eqns[s0 + i], eqns[s + i]
    # The same jaxpr equation, or synthetic ones of one name.
    same = f0.eqn is fk.eqn if f0.fn is None else fk.fn is not None and f0.name == fk.name
    if not same or len(f0.ins) != len(fk.ins) or len(f0.outs) != len(fk.outs):
      return False
    for a0, ak in zip(f0.ins, fk.ins):
      if is_key(a0) and a0 in pos0:
        if not is_key(ak) or pos_k.get(ak) != pos0[a0]:
          return False
      elif i >= ncar and not _same_atom(a0, ak, const_keys):  # A carry reads the last step.
        return False
  return True


def _scan_group(steps, ncar, nxs, reverse, stack_start, stop, eqns, outvars, const_keys):
  """The `ScanGroup` of one unrolled scan, or None when its steps differ (kept unrolled)."""
  s0, e0, _ = steps[0]
  keys0 = [k for fe in eqns[s0:e0] for k in fe.outs]
  pos0 = {k: p for p, k in enumerate(keys0)}
  keys = []
  for s, e, _ in steps:
    keys_k = [k for fe in eqns[s:e] for k in fe.outs]
    pos_k = {k: p for p, k in enumerate(keys_k)}
    if e - s != e0 - s0 or not _same_step(eqns, s0, s, e0 - s0, ncar, pos0, pos_k, const_keys):
      return None
    keys.append(tuple(keys_k))
  carry_out = tuple(c for _, _, c in steps)
  for k in range(len(steps) - 1):  # Step k+1's carry identities read step k's carry outs.
    if tuple(eqns[steps[k + 1][0] + j].ins[0] for j in range(ncar)) != tuple(carry_out[k]):
      return None
  if any(is_key(c) and c not in pos0 and c not in const_keys for c in carry_out[0]):
    return None  # A carry out computed before the scan: kept unrolled (rare).
  stacks = []
  for i in range(stack_start, stop):
    parts = list(eqns[i].ins)[:: -1 if reverse else 1]  # In step order.
    p = pos0.get(parts[0]) if parts and is_key(parts[0]) else None
    if p is not None and parts == [step[p] for step in keys]:
      stacks.append((i, p))
  # Which step values are read after the steps, other than by the recognised stackings.
  stacked = {i for i, _ in stacks}
  after = [a for i in range(steps[-1][1], len(eqns)) if i not in stacked for a in eqns[i].ins]
  read = {a for a in after + list(outvars) if is_key(a)}
  needed = [tuple(k for k, step in enumerate(keys) if step[p] in read) for p in range(len(keys0))]
  return ScanGroup(
    steps=tuple((s, e) for s, e, _ in steps),
    ncar=ncar,
    reverse=reverse,
    keys=tuple(keys),
    carry_out=carry_out,
    xs=tuple(eqns[s0 + ncar + j].ins[0] for j in range(nxs)),
    outside=tuple((p, n) for p, n in enumerate(needed) if n),
    stacks=tuple(stacks),
    stop=stop,
  )


def _stack_fn(aval, *parts):
  return [jnp.stack([jnp.broadcast_to(jnp.asarray(p, aval.dtype), aval.shape[1:]) for p in parts])]

"""A flat view of a traced function: transformations inlined, one equation list.

The scanner matches layers on this list and the curvature pass evaluates it with taps (a zero
perturbation added to each layer output, the layer inputs recorded). What is seen through:

  * nested `jit` / `pjit` / `closed_call`: inlined; nothing changes.
  * `checkpoint` / remat (`jax.checkpoint` with any policy, linen `nn.remat`, `nnx.remat`) whose
    inputs include a parameter (or a view of one): inlined, and its equations recorded as a
    `Region`. `evaluate` runs a region's equations inside a `jax.checkpoint`-wrapped closure with
    the original policy and `prevent_cse`, whose outputs are the region's values read later plus
    the watched values made inside it (the taps' perturbed outputs and recorded inputs), so the
    program that runs rematerialises the block as the user wrote it.
  * `custom_jvp` / `custom_vjp` calls whose inputs include a parameter (or a view of one):
    inlined, and differentiated through the primal function (the custom rule is dropped there).
    Calls that read no parameter (activations such as `jax.nn.relu` / `gelu`, losses) stay
    opaque, re-bound with their custom rules.
  * `lax.scan` whose operands depend on the parameters (an RNN over time: linen `nn.scan` /
    `nn.RNN`, nnx `nnx.scan`, a scan over stacked layers): unrolled. Its static `length` T gives
    T copies of the body, each step's `xs` slice and the stacking of the `ys` become small
    synthetic equations, so a parameter closed over by the body is seen with T uses (each with
    its own output key), and a stacked parameter passed in `xs` is seen as T slices, one per step
    (the scanner makes them one stacked layer). Cost: the graph (and the program XLA compiles
    from the tapped function) grows T-fold, so trace and compile time grow linearly in T; the
    arithmetic is unchanged.

Other higher-order primitives (`cond`, `while`), scans that touch no parameter, and remat or
custom-derivative calls that read no parameter stay opaque equations and are re-bound as they are.

Values are keyed by `(instance, Var)`: the same inner jaxpr object can be called twice (JAX
caches traces), so each inlined call gets its own instance number.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

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
_SCAN_STACK = _SynthPrimitive("scan_stack")


def is_key(atom: Atom) -> bool:
  return isinstance(atom, tuple)


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


# Operations through which a value stays "a parameter" for deciding what to inline.
_PARAM_VIEW_OPS = frozenset({
    "convert_element_type", "copy", "copy_p", "reshape", "transpose", "broadcast_in_dim",
    "squeeze", "slice", "dynamic_slice", "expand_dims", "scan_slice"})


@dataclasses.dataclass(frozen=True, eq=False)
class FlatGraph:
  """The equations of a closed jaxpr with calls, remat and parameter scans inlined."""

  invars: tuple[Key, ...]
  outvars: tuple[Atom, ...]
  consts: tuple[tuple[Key, Any], ...]
  eqns: tuple[FlatEqn, ...]
  regions: tuple[Region, ...] = ()

  @classmethod
  def from_closed_jaxpr(cls, closed: _compat.ClosedJaxpr, n_params: int = 0) -> FlatGraph:
    """Flattens `closed`; scans reading any of its first `n_params` inputs are unrolled."""
    counter = [0]
    consts: list[tuple[Key, Any]] = []
    eqns: list[FlatEqn] = []
    dep: set[Key] = {(0, v) for v in closed.jaxpr.invars[:n_params]}
    pview: set[Key] = set(dep)  # Parameters and their views (slices, casts, reshapes).
    regions: list[tuple[int, int, Mapping[str, Any]]] = []
    remat_depth = [0]

    def unroll_scan(eqn, ins, instance, alias, walk):
      p = eqn.params
      body = p["jaxpr"]
      nc, ncar, length = p["num_consts"], p["num_carry"], int(p["length"])
      consts_in, carry = list(ins[:nc]), list(ins[nc:nc + ncar])
      xs = ins[nc + ncar:]
      ys_steps: list[list[Atom]] = [None] * length  # type: ignore[list-item]
      for t in (reversed(range(length)) if p["reverse"] else range(length)):
        x_t = []
        for x in xs:
          aval = aval_of(x).update(shape=aval_of(x).shape[1:])
          key = (instance, _SynthVar(aval))
          eqns.append(FlatEqn(_SynthEqn(_SCAN_SLICE, {"index": t}), (x,), (key,),
                              fn=functools.partial(_slice_fn, t)))
          if is_key(x) and x in dep:
            dep.add(key)
          if is_key(x) and x in pview:
            pview.add(key)
          x_t.append(key)
        counter[0] += 1
        inner = counter[0]
        inner_alias = dict(zip(body.jaxpr.invars, consts_in + carry + x_t))
        walk(body.jaxpr, inner, body.consts, inner_alias)
        outs = [a if isinstance(a, _compat.Literal) else inner_alias.get(a, (inner, a))
                for a in body.jaxpr.outvars]
        carry, ys_steps[t] = outs[:ncar], outs[ncar:]
      for v, a in zip(eqn.outvars[:ncar], carry):
        alias[v] = a
      for n, v in enumerate(eqn.outvars[ncar:]):
        parts = tuple(ys_steps[t][n] for t in range(length))
        key = (instance, v)
        eqns.append(FlatEqn(_SynthEqn(_SCAN_STACK, {"length": length}), parts, (key,),
                            fn=functools.partial(_stack_fn, v.aval)))
        if any(a in dep for a in parts if is_key(a)):
          dep.add(key)

    def walk(jaxpr, instance: int, const_vals, alias: dict[Any, Atom]) -> None:
      def resolve(atom):
        if isinstance(atom, _compat.Literal):
          return atom
        return alias.get(atom, (instance, atom))

      for v, c in zip(jaxpr.constvars, const_vals):
        consts.append(((instance, v), c))
      for eqn in jaxpr.eqns:
        ins = tuple(resolve(a) for a in eqn.invars)
        if (eqn.primitive.name == "scan" and int(eqn.params["length"]) > 0
            and any(is_key(a) and a in dep for a in ins)):
          unroll_scan(eqn, ins, instance, alias, walk)
          continue
        sub, kind = _compat.call_jaxpr_of(eqn), "call"
        if sub is None:
          found = _compat.transparent_jaxpr_of(eqn)
          if found is not None and any(is_key(a) and a in pview for a in ins):
            sub, kind = found
        if sub is not None:
          start = len(eqns)
          remat_depth[0] += kind == "remat"
          inline(eqn, sub, ins, instance, alias, walk)
          remat_depth[0] -= kind == "remat"
          if kind == "remat" and not remat_depth[0] and len(eqns) > start:
            regions.append((start, len(eqns), _compat.remat_options(eqn)))
          continue
        outs = tuple((instance, v) for v in eqn.outvars)
        if any(is_key(a) and a in dep for a in ins):
          dep.update(outs)
        if eqn.primitive.name in _PARAM_VIEW_OPS and ins and is_key(ins[0]) and ins[0] in pview:
          pview.update(outs)
        eqns.append(FlatEqn(eqn, ins, outs))

    def inline(eqn, sub, ins, instance, alias, walk):
      del instance
      counter[0] += 1
      inner = counter[0]
      inner_alias = dict(zip(sub.jaxpr.invars, ins))
      walk(sub.jaxpr, inner, sub.consts, inner_alias)
      # The call's outputs are the inner jaxpr's outputs.
      for outer_v, inner_atom in zip(eqn.outvars, sub.jaxpr.outvars):
        r = inner_atom if isinstance(inner_atom, _compat.Literal) else inner_alias.get(
            inner_atom, (inner, inner_atom))
        alias[outer_v] = r

    top_alias: dict[Any, Atom] = {}
    walk(closed.jaxpr, 0, closed.consts, top_alias)
    outvars = tuple(
        a if isinstance(a, _compat.Literal) else top_alias.get(a, (0, a))
        for a in closed.jaxpr.outvars)
    return cls(tuple((0, v) for v in closed.jaxpr.invars), outvars, tuple(consts), tuple(eqns),
               _regions(regions, eqns, outvars, {k for k, _ in consts}))

  def consumers(self) -> dict[Key, list[tuple[int, int]]]:
    """Maps each key to the (equation index, operand position) pairs that read it."""
    out: dict[Key, list[tuple[int, int]]] = {}
    for i, fe in enumerate(self.eqns):
      for pos, a in enumerate(fe.ins):
        if is_key(a):
          out.setdefault(a, []).append((i, pos))
    return out

  def evaluate(
      self,
      args: Sequence[Any],
      on_output: Callable[[Key, Any], Any] | None = None,
      watch: frozenset[Key] = frozenset(),
  ) -> tuple[list[Any], dict[Key, Any]]:
    """Evaluates the graph on `args` (arrays or tracers).

    Args:
      args: one value per input variable.
      on_output: called as `on_output(key, value)` for every value produced by an equation whose
        key is in `watch`; its return value replaces the value (used to add perturbations).
      watch: the keys to report; their final values are also returned.

    Returns:
      The outputs, and the watched values.
    """
    env: dict[Key, Any] = dict(self.consts)
    if len(args) != len(self.invars):
      raise ValueError(f"expected {len(self.invars)} inputs, got {len(args)}")
    seen: dict[Key, Any] = {}

    def write(k, v):
      if k in watch:
        if on_output is not None:
          v = on_output(k, v)
        seen[k] = v
      env[k] = v

    for k, v in zip(self.invars, args):
      write(k, v)

    def read(a):
      return a.val if isinstance(a, _compat.Literal) else env[a]

    regions = {r.start: r for r in self.regions}
    i = 0
    while i < len(self.eqns):
      r = regions.get(i)
      if r is not None:
        self._evaluate_region(r, env, seen, on_output, watch)
        i = r.stop
        continue
      fe = self.eqns[i]
      vals = [read(a) for a in fe.ins]
      outs = fe.fn(*vals) if fe.fn is not None else _compat.bind_eqn(fe.eqn, vals)
      for k, v in zip(fe.outs, outs):
        write(k, v)
      i += 1
    return [read(a) for a in self.outvars], seen

  def _evaluate_region(self, r: Region, env, seen, on_output, watch) -> None:
    """Evaluates `eqns[r.start:r.stop]` under `jax.checkpoint` with the region's options.

    The closure's inputs are the values the region reads; its outputs are the values read after
    it and the watched values it makes (after `on_output`), so taps inside a rematerialised
    block work and only what they record is kept beyond the block's own inputs.
    """
    made = [k for fe in self.eqns[r.start:r.stop] for k in fe.outs]
    watched = [k for k in made if k in watch]
    out_keys = list(dict.fromkeys(list(r.outs) + watched))

    def body(*in_vals):
      local = dict(zip(r.ins, in_vals))

      def read(a):
        if isinstance(a, _compat.Literal):
          return a.val
        return local[a] if a in local else env[a]

      for fe in self.eqns[r.start:r.stop]:
        vals = [read(a) for a in fe.ins]
        outs = fe.fn(*vals) if fe.fn is not None else _compat.bind_eqn(fe.eqn, vals)
        for k, v in zip(fe.outs, outs):
          if k in watch and on_output is not None:
            v = on_output(k, v)
          local[k] = v
      return [local[k] for k in out_keys]

    vals = jax.checkpoint(body, **r.options)(*[env[k] for k in r.ins])
    for k, v in zip(out_keys, vals):
      env[k] = v
      if k in watch:
        seen[k] = v


def _regions(ranges, eqns, outvars, const_keys) -> tuple[Region, ...]:
  """`Region`s with their input and output keys, from `(start, stop, options)` ranges."""
  last_read: dict[Key, int] = {}
  for i, fe in enumerate(eqns):
    for a in fe.ins:
      if is_key(a):
        last_read[a] = i
  for a in outvars:
    if is_key(a):
      last_read[a] = len(eqns)
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


def _slice_fn(t: int, x):
  return [x[t]]


def _stack_fn(aval, *parts):
  return [jnp.stack([jnp.broadcast_to(jnp.asarray(p, aval.dtype), aval.shape[1:]) for p in parts])]

"""A flat view of a traced function: nested `jit` calls inlined, one equation list.

The scanner matches layers on this list and the curvature pass evaluates it with taps (a zero
perturbation added to each layer output, the layer inputs recorded). Inlining a nested `jit`
does not change what is computed. A `lax.scan` whose operands depend on the parameters (an RNN
over time: linen `nn.scan` / `nn.RNN`, nnx `nnx.scan` / `nnx.RNN`, plain `lax.scan`) is unrolled:
its static `length` T gives T copies of the body, each step's `xs` slice and the stacking of the
`ys` become small synthetic equations, so a parameter used in the body is seen with T uses, each
with its own output key. Cost: the graph (and the program XLA compiles from the tapped function)
grows T-fold, so trace and compile time grow linearly in T; the arithmetic is unchanged. Other
higher-order primitives (`cond`, `while`, `custom_jvp`, `checkpoint`) and scans that touch no
parameter stay opaque equations and are re-bound as they are.

Values are keyed by `(instance, Var)`: the same inner jaxpr object can be called twice (JAX
caches traces), so each inlined call gets its own instance number.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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
class FlatGraph:
  """The equations of a closed jaxpr with nested `jit` calls inlined."""

  invars: tuple[Key, ...]
  outvars: tuple[Atom, ...]
  consts: tuple[tuple[Key, Any], ...]
  eqns: tuple[FlatEqn, ...]

  @classmethod
  def from_closed_jaxpr(cls, closed: _compat.ClosedJaxpr, n_params: int = 0) -> FlatGraph:
    """Flattens `closed`; scans reading any of its first `n_params` inputs are unrolled."""
    counter = [0]
    consts: list[tuple[Key, Any]] = []
    eqns: list[FlatEqn] = []
    dep: set[Key] = {(0, v) for v in closed.jaxpr.invars[:n_params]}

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
        sub = _compat.call_jaxpr_of(eqn)
        if sub is not None:
          counter[0] += 1
          inner = counter[0]
          inner_alias = dict(zip(sub.jaxpr.invars, ins))
          walk(sub.jaxpr, inner, sub.consts, inner_alias)
          # The call's outputs are the inner jaxpr's outputs.
          for outer_v, inner_atom in zip(eqn.outvars, sub.jaxpr.outvars):
            r = inner_atom if isinstance(inner_atom, _compat.Literal) else inner_alias.get(
                inner_atom, (inner, inner_atom))
            alias[outer_v] = r
          continue
        outs = tuple((instance, v) for v in eqn.outvars)
        if any(is_key(a) and a in dep for a in ins):
          dep.update(outs)
        eqns.append(FlatEqn(eqn, ins, outs))

    top_alias: dict[Any, Atom] = {}
    walk(closed.jaxpr, 0, closed.consts, top_alias)
    outvars = tuple(
        a if isinstance(a, _compat.Literal) else top_alias.get(a, (0, a))
        for a in closed.jaxpr.outvars)
    return cls(tuple((0, v) for v in closed.jaxpr.invars), outvars, tuple(consts), tuple(eqns))

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

    for fe in self.eqns:
      vals = [read(a) for a in fe.ins]
      outs = fe.fn(*vals) if fe.fn is not None else _compat.bind_eqn(fe.eqn, vals)
      for k, v in zip(fe.outs, outs):
        write(k, v)
    return [read(a) for a in self.outvars], seen


def _slice_fn(t: int, x):
  return [x[t]]


def _stack_fn(aval, *parts):
  return [jnp.stack([jnp.broadcast_to(jnp.asarray(p, aval.dtype), aval.shape[1:]) for p in parts])]

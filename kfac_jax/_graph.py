"""A flat view of a traced function: nested `jit` calls inlined, one equation list.

The scanner matches layers on this list and the curvature pass evaluates it with taps (a zero
perturbation added to each layer output, the layer inputs recorded). Inlining a nested `jit`
does not change what is computed; other higher-order primitives (`scan`, `cond`, `custom_jvp`,
`checkpoint`) stay opaque equations and are re-bound as they are.

Values are keyed by `(instance, Var)`: the same inner jaxpr object can be called twice (JAX
caches traces), so each inlined call gets its own instance number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kfac_jax import _compat

Key = tuple[int, Any]  # (instance, Var)
Atom = Any  # Key or _compat.Literal


@dataclasses.dataclass(frozen=True, eq=False)
class FlatEqn:
  eqn: _compat.JaxprEqn
  ins: tuple[Atom, ...]
  outs: tuple[Key, ...]

  @property
  def name(self) -> str:
    return self.eqn.primitive.name

  @property
  def params(self) -> Mapping[str, Any]:
    return self.eqn.params


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
  def from_closed_jaxpr(cls, closed: _compat.ClosedJaxpr) -> FlatGraph:
    counter = [0]
    consts: list[tuple[Key, Any]] = []
    eqns: list[FlatEqn] = []

    def walk(jaxpr, instance: int, const_vals, alias: dict[Any, Atom]) -> None:
      def resolve(atom):
        if isinstance(atom, _compat.Literal):
          return atom
        return alias.get(atom, (instance, atom))

      for v, c in zip(jaxpr.constvars, const_vals):
        consts.append(((instance, v), c))
      for eqn in jaxpr.eqns:
        ins = tuple(resolve(a) for a in eqn.invars)
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
        eqns.append(FlatEqn(eqn, ins, tuple((instance, v) for v in eqn.outvars)))

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
      outs = _compat.bind_eqn(fe.eqn, [read(a) for a in fe.ins])
      for k, v in zip(fe.outs, outs):
        write(k, v)
    return [read(a) for a in self.outvars], seen

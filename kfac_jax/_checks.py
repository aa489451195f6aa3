"""Argument checks shared by the public constructors: a wrong kind of value raises `TypeError`,
one out of range `ValueError`, naming the argument; traced values (injected hyperparameters) pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def is_traced(value) -> bool:
  return isinstance(value, jax.core.Tracer)


def describe(value) -> str:
  if isinstance(value, (jax.Array, np.ndarray)):
    return f"{value!r}"
  return f"{value!r} ({type(value).__name__})"


def _as_float(value, name: str, expected: str) -> float | None:
  """The value as a float; None when traced. TypeError for anything but a real scalar."""
  if is_traced(value):
    return None
  if isinstance(value, (bool, np.bool_)) or value is None or isinstance(value, (str, bytes)):
    raise TypeError(f"`{name}` must be {expected}, got {describe(value)}.")
  if isinstance(value, (int, float, np.integer, np.floating)):
    return float(value)
  if isinstance(value, (jax.Array, np.ndarray)):
    if (
      np.shape(value) != ()
      or not np.issubdtype(value.dtype, np.number)
      or np.issubdtype(value.dtype, np.complexfloating)
    ):
      raise TypeError(
        f"`{name}` must be {expected}, got an array of shape {np.shape(value)} "
        f"and dtype {value.dtype}: {value!r}."
      )
    return float(value)
  raise TypeError(f"`{name}` must be {expected}, got {describe(value)}.")


def number(
  value,
  name: str,
  *,
  low: float = -math.inf,
  low_open: bool = False,
  high: float = math.inf,
  high_open: bool = False,
  schedule: bool = False,
) -> None:
  """A finite real scalar in the interval (or, with `schedule`, a callable `count -> value`)."""
  if schedule and callable(value) and not isinstance(value, (jax.Array, np.ndarray)):
    return
  if high == math.inf and low in (0, -math.inf):
    expected = "a finite number" + ("" if low else " > 0" if low_open else " >= 0")
  else:
    lo, hi = ("(" if low_open else "[") + f"{low:g}", f"{high:g}" + (")" if high_open else "]")
    expected = f"a number in {lo}, {hi}"
  if schedule:
    expected += " or a schedule `count -> value`"
  v = _as_float(value, name, expected)
  if v is None:
    return
  ok = (
    math.isfinite(v)
    and (v > low if low_open else v >= low)
    and (v < high if high_open else v <= high)
  )
  if not ok:
    raise ValueError(f"`{name}` must be {expected}, got {describe(value)}.")


def concrete_number(value, name: str, where: str, **bounds) -> None:
  """`number` (with `low=0` unless given) that also refuses a traced value: "`where` outside
  jit" says what to build there."""
  if is_traced(value):
    raise TypeError(
      f"`{name}` must be a concrete number, got a traced value {value!r}: {where} outside jit."
    )
  number(value, name, **({"low": 0.0} | bounds))


def positive_int(value, name: str) -> None:
  """An integer >= 1 (a Python int, a numpy integer or a 0-d integer-valued array)."""
  expected = "a positive integer"
  v = _as_float(value, name, expected)
  if v is not None and (not math.isfinite(v) or v != int(v) or v < 1):
    raise ValueError(f"`{name}` must be {expected}, got {describe(value)}.")


def _static(value, name: str, what: str, kinds: tuple[type, ...]) -> bool:
  """TypeError unless `value` is a Python (or numpy scalar) number; whether it is of `kinds`."""
  if isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, np.generic):
    raise TypeError(
      f"`{name}` fixes array shapes and must be a Python number, got a "
      f"{type(value).__name__}: {value!r}."
    )
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
    raise TypeError(f"`{name}` must be {what}, got {describe(value)}.")
  return isinstance(value, kinds)


def static_int(value, name: str, *, low: int = 1) -> None:
  """A Python int >= `low` that fixes array shapes (never traced)."""
  what = f"an int >= {low}"
  if not _static(value, name, what, (int, np.integer)) or value < low:
    raise ValueError(f"`{name}` must be {what}, got {describe(value)}.")


def static_fraction(value, name: str) -> None:
  """A Python number in (0, 1] or "auto" (checked by the caller) that fixes array shapes."""
  what = 'a number in (0, 1] or "auto"'
  if not _static(value, name, what, (int, float, np.number)) or not (0 < value <= 1):
    raise ValueError(f"`{name}` must be {what}, got {value!r}.")


def boolean(value, name: str) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"`{name}` must be a bool (True or False), got {describe(value)}.")


def choice(value, name: str, choices: Sequence[Any]) -> None:
  if not isinstance(value, str) or value not in choices:
    raise (ValueError if isinstance(value, str) else TypeError)(
      f"unknown {name} {value!r}; choose one of {', '.join(repr(c) for c in choices)}."
    )


def optional_str(value, name: str) -> None:
  if value is not None and not isinstance(value, str):
    raise TypeError(f"`{name}` must be a string or None, got {describe(value)}.")


def function(value, name: str) -> None:
  if not callable(value):
    raise TypeError(f"`{name}` must be callable, got {describe(value)}.")


def axis_bound(axis_name, who: str) -> None:
  """ValueError naming `axis_name` when a name of it is not bound where the front is called."""
  if axis_name is None:
    return
  for name in axis_name if isinstance(axis_name, tuple) else (axis_name,):
    try:
      jax.lax.axis_size(name)
    except NameError:
      raise ValueError(
        f"{who}: `axis_name`={name!r} is not bound here: call it inside `jax.pmap(..., "
        f"axis_name={name!r})` or `jax.shard_map` over mesh axis {name!r}, or pass None (jit)."
      ) from None

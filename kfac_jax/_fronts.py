"""What the fronts share: the source of their estimator, and the share of the parameters
`optax.multi_transform` / `optax.masked` hand them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from kfac_jax import _checks, _estimator, _registration

Estimator = _estimator.Estimator


@dataclasses.dataclass(frozen=True, eq=False)
class Source:
  """Where a front's `Estimator` comes from: a registration (built at once), or `loss_fn` and
  the first params it sees (built once, cached); later params must have the same signature (an
  error names the first leaf that differs).

  Attributes:
    make: `registration -> Estimator`.
    loss_fn, example_batch, settings: scanned with the first params (`settings`: the
      `Registration` keyword arguments), without `registration`.
    registration: given instead of `loss_fn`, or None.
  """

  make: Callable[[_registration.Registration], Estimator]
  loss_fn: Any = None
  example_batch: Any = None
  settings: dict[str, Any] = dataclasses.field(default_factory=dict)
  registration: _registration.Registration | None = None
  _built: list[Estimator] = dataclasses.field(default_factory=list, repr=False)  # 0 or 1

  def __post_init__(self):
    if self.registration is not None:
      self._built.append(self.make(self.registration))

  @property
  def registered(self) -> bool:
    """Whether the estimator is known."""
    return bool(self._built)

  def only(self) -> Estimator:
    """The estimator, once known."""
    if not self._built:
      raise RuntimeError("call `init(params)` first: the layers are found when params are known.")
    return self._built[0]

  def for_params(self, params, axis_name=None) -> Estimator:
    """The estimator for `params`, checked against the signature this front serves."""
    if not self._built:
      reg = _registration.Registration(
        self.loss_fn, params, self.example_batch, axis_name=axis_name, **self.settings
      )
      self._built.append(self.make(reg))
    self._built[0].registration.check_params(params)
    return self._built[0]


def resolve(registration, loss_fn, example_batch, config, who: str):
  """`registration` checked against `config`'s registration fields (None without one)."""
  fields = config.registration_settings()
  del fields["check_loss"]  # Not among the settings a registration is checked against.
  settings = _registration.estimator_settings(**fields, prefix="config.")
  return _registration.resolve(registration, loss_fn, example_batch, who, settings)


def for_front(loss_fn, example_batch, registration, config, who: str) -> Source:
  """The estimator `Source` of a transform or the Optimizer."""
  reg = resolve(registration, loss_fn, example_batch, config, who)
  if reg is None:
    if loss_fn is None:
      raise TypeError(
        f"{who}: pass `loss_fn` and `example_batch`, or `registration=` (a kfac_jax.Registration)."
      )
    _checks.function(loss_fn, "loss_fn")
  make = functools.partial(
    Estimator,
    config=config.block_config(),
    storage=config.storage,
    who=f"this {who}" + ("" if who == "Optimizer" else " transform"),
  )
  return Source(make, loss_fn, example_batch, config.registration_settings(), reg)


def is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def masked_share(tree) -> tuple[bool, ...] | None:
  """Per leaf of `tree`, masked ones included, whether it is not an `optax.MaskedNode` (the share
  `optax.multi_transform` / `optax.masked` hand a transform); None when none is masked."""
  kept = tuple(not is_masked(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_masked))
  return None if all(kept) else kept


def fill(est: Estimator, share, abstract: bool = False):
  """`share` with its `optax.MaskedNode` leaves replaced by zeros of the registered shapes and
  dtypes (`jax.ShapeDtypeStruct`s with `abstract`): the whole params' structure."""
  flat, treedef = jax.tree_util.tree_flatten(share, is_leaf=is_masked)
  sig = est.registration.param_signature[1]
  if len(flat) != len(sig):  # Wrong structure: `check_params` names the leaf.
    return jax.tree_util.tree_unflatten(treedef, flat)
  make = jax.ShapeDtypeStruct if abstract else jnp.zeros
  leaves = [
    make(shape, jnp.dtype(dtype)) if is_masked(x) else x for x, (shape, dtype) in zip(flat, sig)
  ]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def unfill(full, share):
  """`full` (the whole params' structure) at `share`'s unmasked leaves, in `share`'s structure."""
  flat, treedef = jax.tree_util.tree_flatten(share, is_leaf=is_masked)
  leaves = jax.tree_util.tree_leaves(full)
  return jax.tree_util.tree_unflatten(
    treedef, [x if is_masked(x) else y for x, y in zip(flat, leaves)]
  )


def estimator_for(source: Source, params, who: str, axis_name=None):
  """`(estimator, kept)`: the complete estimator for `params`, restricted to the share when
  `params` has `optax.MaskedNode` leaves (`kept`: per registered leaf, whether it is in it)."""
  if not jax.tree_util.tree_leaves(params, is_leaf=is_masked) and source.registered:
    # A tree without leaves: `optax.tree_map_params`' placeholder, which asks only for the
    # state's structure (the layers are known from an earlier `init`).
    return source.only(), None
  kept = masked_share(params)
  if kept is None:
    return source.for_params(params, axis_name), None
  if not source.registered:
    raise ValueError(
      f"{who}: `params` has optax.MaskedNode leaves: optax.multi_transform or "
      "optax.masked hands this transform only its share of the parameters, and the model "
      "cannot be traced without the rest. Build the layers from the whole params, "
      "`reg = kfac_jax.Registration(loss_fn, params, batch)`, and pass `registration=reg` "
      f"to {who} and to kfac_jax.value_and_grad."
    )
  est = source.only()
  est.registration.check_params(fill(est, params, abstract=True))
  return est.restrict(kept), kept

"""Tags: no-op JAX primitives that mark losses and layers in a traced function (docs/layers.rst).

The tagged loss is the sum over the non-leading axes and the mean over the leading (batch) axis
of `weight * nll(prediction, target)`.
"""

from __future__ import annotations

import itertools
import math
from typing import Any
from typing import Literal as TypingLiteral

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _checks, _compat

Array = jax.Array
LossKind = TypingLiteral["categorical", "bernoulli", "normal"]


def _make_tag_primitive(name: str) -> _compat.Primitive:
  """A primitive whose first `n_out` operands are its outputs."""
  prim = _compat.Primitive(name)
  prim.multiple_results = True

  def first(*args, n_out, **_):
    return list(args[:n_out])

  def jvp(primals, tangents, *, n_out, **params):
    return prim.bind(*primals, n_out=n_out, **params), list(tangents[:n_out])

  def batch(args, dims, *, n_out, **params):
    # Marked, so the scanner can reject a loss tag that only saw one example (a vmapped loss).
    return prim.bind(*args, n_out=n_out, **params, under_vmap=True), list(dims[:n_out])

  prim.def_impl(first)
  prim.def_abstract_eval(first)
  _compat.ad.primitive_jvps[prim] = jvp
  _compat.batching.primitive_batchers[prim] = batch
  _compat.mlir.register_lowering(prim, lambda ctx, *args, **params: first(*args, **params))
  return prim


loss_tag_p = _make_tag_primitive("kfac_loss_tag")
layer_tag_p = _make_tag_primitive("kfac_layer_tag")


def _check_array(value: Any, arg: str, fn: str) -> Array:
  if not isinstance(value, (jax.Array, np.ndarray, np.generic)) and not hasattr(value, "aval"):
    raise TypeError(f"{fn}: `{arg}` must be an array, got {type(value).__name__}.")
  return jnp.asarray(value)


def _bind_loss(kind: LossKind, fn: str, prediction, targets, weight, var: float = 1.0) -> Array:
  prediction = _check_array(prediction, "prediction", fn)
  if kind == "normal" and jnp.iscomplexobj(prediction):
    return _bind_complex_normal(fn, prediction, targets, weight, var)
  if not jnp.issubdtype(prediction.dtype, jnp.floating):
    raise TypeError(f"{fn}: the prediction must be floating point, got dtype {prediction.dtype}.")
  if prediction.ndim < 1:
    raise ValueError(f"{fn}: the prediction needs a leading batch axis, got a scalar.")
  if kind == "categorical" and prediction.ndim < 2:
    raise ValueError(
      f"{fn}: logits must have shape [batch, ..., num_classes], got {prediction.shape}."
    )
  operands = [prediction]
  if targets is not None:
    targets = _check_array(targets, "targets", fn)
    ok_shapes = [prediction.shape] + ([prediction.shape[:-1]] if kind == "categorical" else [])
    if targets.shape not in ok_shapes:
      expect = " or ".join(str(s) for s in ok_shapes)
      raise ValueError(f"{fn}: `targets` has shape {targets.shape}, expected {expect}.")
    if targets.shape != prediction.shape and not jnp.issubdtype(targets.dtype, jnp.integer):
      raise TypeError(f"{fn}: class-index `targets` must be integers, got {targets.dtype}.")
    operands.append(targets)
  if weight is not None:
    if isinstance(weight, (int, float)) and not isinstance(weight, bool):
      weight = np.asarray(weight, prediction.dtype)
    event_shape = prediction.shape[:-1] if kind == "categorical" else prediction.shape
    operands.append(_check_weight(weight, event_shape, fn).astype(prediction.dtype))
  if not (isinstance(var, (int, float)) and var > 0 and math.isfinite(var)):
    raise ValueError(f"{fn}: `var` must be a positive finite Python number, got {var!r}.")
  has = {"has_targets": targets is not None, "has_weight": weight is not None}
  return loss_tag_p.bind(*operands, n_out=1, kind=kind, **has, var=float(var), fn=fn)[0]


def _check_weight(weight, event_shape: tuple[int, ...], fn: str) -> Array:
  """`weight` as an array, checked to broadcast to `event_shape` axis by axis."""
  weight = _check_array(weight, "weight", fn)
  ok = weight.ndim == 0 or (
    weight.ndim == len(event_shape) and all(w in (1, e) for w, e in zip(weight.shape, event_shape))
  )
  if not ok:
    per_example = event_shape[:1] + (1,) * (len(event_shape) - 1)
    raise ValueError(
      f"{fn}: `weight` of shape {weight.shape} does not broadcast to {event_shape} axis by axis: "
      f"give a scalar, {per_example} for a weight per example, or each axis 1 or its size."
    )
  return weight


def _bind_complex_normal(fn: str, prediction, targets, weight, var: float) -> Array:
  """A complex mean `z` tagged as the normal of `[..., 2] = (Re z, Im z)`; `z` from the tag."""
  parts = lambda z: jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1)  # noqa: E731
  if targets is not None:
    targets = _check_array(targets, "targets", fn)
    if targets.shape != prediction.shape:
      raise ValueError(f"{fn}: `targets` has shape {targets.shape}, expected {prediction.shape}.")
    targets = parts(targets)
  if weight is not None and not isinstance(weight, (int, float)):
    weight = _check_weight(weight, prediction.shape, fn)
    if weight.ndim:
      weight = weight[..., None]  # One weight for both parts.
  out = _bind_loss("normal", fn, parts(prediction), targets, weight, var)
  return jax.lax.complex(out[..., 0], out[..., 1])


def register_categorical_predictive_distribution(logits, targets=None, weight=None) -> Array:
  """Tags `logits` as the parameters of a categorical distribution (softmax cross-entropy).

  Args:
    logits: `[batch, ..., num_classes]` unnormalised log-probabilities.
    targets: optional class indices `[batch, ...]` or probabilities of `logits`' shape; needed
      only for the empirical Fisher.
    weight: optional non-negative multiplicity: a scalar, or of `logits.shape[:-1]`'s rank with
      each axis 1 or its size.

  Returns:
    `logits`, unchanged.

  Example:
    >>> def loss_fn(params, batch):
    ...   logits = model.apply(params, batch["x"])
    ...   kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    ...   return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  """
  return _bind_loss("categorical", "register_softmax_cross_entropy_loss", logits, targets, weight)


def register_multi_bernoulli_predictive_distribution(logits, targets=None, weight=None) -> Array:
  """Tags `logits` as independent Bernoulli logits (sigmoid cross-entropy, summed over units).

  Args:
    logits: `[batch, ...]` logits.
    targets: optional `{0, 1}` (or probability) targets of the same shape.
    weight: optional non-negative multiplicity: a scalar, or of `logits`' rank with each axis 1
      or its size.

  Returns:
    `logits`, unchanged.
  """
  return _bind_loss("bernoulli", "register_sigmoid_cross_entropy_loss", logits, targets, weight)


def register_normal_predictive_distribution(
  mean, targets=None, var: float = 0.5, weight=None
) -> Array:
  """Tags `mean` as the mean of a normal with fixed scalar variance `var`.

  The negative log-likelihood is `|t - mean|² / (2 var)` (+ const); the default `var=0.5`
  gives the squared error, Fisher `2 I`. A complex `mean` is the normal of its real and
  imaginary parts: for real parameters the Fisher is `Re E[conj(J)ᵀ J] / var`, `J = ∂mean/∂θ`.

  Args:
    mean: `[batch, ...]` predictions, real or complex.
    targets: optional targets of the same shape.
    var: the variance, a positive Python float (static).
    weight: optional non-negative multiplicity: a scalar, or of `mean`'s rank with each axis 1
      or its size.

  Returns:
    `mean`, unchanged.
  """
  return _bind_loss(
    "normal", "register_normal_predictive_distribution", mean, targets, weight, var=var
  )


def register_squared_error_loss(prediction, targets=None, weight=None) -> Array:
  """Tags `prediction` for the squared error `(t - y)²`, summed over the non-batch axes: a
  normal with variance 0.5 (`targets` and `weight` as for that tag)."""
  return _bind_loss("normal", "register_squared_error_loss", prediction, targets, weight, var=0.5)


register_softmax_cross_entropy_loss = register_categorical_predictive_distribution
register_sigmoid_cross_entropy_loss = register_multi_bernoulli_predictive_distribution


def register_dense(y, x, kernel, bias=None, approx: str | None = None) -> Array:
  """Tags `y = x @ kernel (+ bias)` as a dense layer the scanner cannot find by itself.

  Args:
    y, x: the layer output `[..., out]` and input `[..., in]`.
    kernel, bias: `[in, out]` (Flax layout) and optional `[out]` parameter leaves.
    approx: curvature approximation (default "kron"; for a kernel tagged at each of several
      uses, the same shared-layer approximation at each, default "kron_indep").

  Returns:
    `y`, unchanged.
  """
  fn = "register_dense"
  y, x, kernel = (_check_array(v, n, fn) for v, n in ((y, "y"), (x, "x"), (kernel, "kernel")))
  if kernel.ndim != 2:
    raise ValueError(f"{fn}: `kernel` must have shape [in, out], got {kernel.shape}.")
  if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(
      f"{fn}: `x` of shape {x.shape} does not match `kernel` of shape {kernel.shape}: "
      f"expected x.shape[-1] == {kernel.shape[0]}."
    )
  if y.shape != x.shape[:-1] + (kernel.shape[1],):
    raise ValueError(
      f"{fn}: `y` has shape {y.shape}, expected {x.shape[:-1] + (kernel.shape[1],)}."
    )
  return _bind_layer(fn, "dense", [y, x, kernel], approx, bias, kernel.shape[1])


def register_generic(params, approx: str | None = None):
  """Gives the leaves of `params` (one leaf or a pytree) one generic curvature block.

  Args:
    params: a parameter leaf or a pytree of parameter leaves, as used in the loss function.
    approx: "diagonal" (default) or "full".

  Returns:
    `params`, unchanged.
  """
  leaves, treedef = jax.tree_util.tree_flatten(params)
  if not leaves:
    raise ValueError("register_generic: `params` has no array leaves.")
  leaves = [_check_array(v, "params", "register_generic") for v in leaves]
  _checks.optional_str(approx, "approx")
  outs = layer_tag_p.bind(*leaves, n_out=len(leaves), kind="generic", approx=approx)
  return jax.tree_util.tree_unflatten(treedef, outs)


def _bind_layer(fn: str, kind: str, operands, approx, bias=None, out: int = 0, **params):
  """Binds a layer tag on `operands` and, if given, `bias` (checked to be `[out]`)."""
  if bias is not None:
    bias = _check_array(bias, "bias", fn)
    if bias.shape != (out,):
      raise ValueError(f"{fn}: `bias` has shape {bias.shape}, expected ({out},).")
    operands.append(bias)
  _checks.optional_str(approx, "approx")
  return layer_tag_p.bind(*operands, n_out=1, kind=kind, approx=approx, **params)[0]


def register_conv(
  y,
  x,
  kernel,
  bias=None,
  *,
  window_strides,
  padding,
  lhs_dilation=None,
  rhs_dilation=None,
  dimension_numbers=None,
  feature_group_count: int = 1,
  approx: str | None = None,
) -> Array:
  """Tags `y = lax.conv_general_dilated(x, kernel, ...) (+ bias)` as a convolution layer.

  Args:
    y, x: the layer output (bias included, if any) and input.
    kernel: a parameter leaf laid out as `dimension_numbers` says (Flax: "HWIO").
    bias: optional `[out]` parameter leaf, added along the output feature axis.
    window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count:
      as for `conv_general_dilated` (checked to reproduce `y.shape`).
    approx: "kron" (default; "diagonal" for depthwise), "kron_sua", "diagonal" or "full".

  Returns:
    `y`, unchanged.
  """
  fn = "register_conv"
  y, x, kernel = (_check_array(v, n, fn) for v, n in ((y, "y"), (x, "x"), (kernel, "kernel")))
  spatial = (window_strides, lhs_dilation, rhs_dilation)
  conv = _conv_arguments(fn, x, kernel, spatial, padding, dimension_numbers, feature_group_count)
  try:
    expected = jax.eval_shape(lambda a, k: jax.lax.conv_general_dilated(a, k, **conv), x, kernel)
    expected = expected.shape
  except (TypeError, ValueError) as e:
    raise ValueError(
      f"{fn}: `x` {x.shape} and `kernel` {kernel.shape} do not convolve with these arguments: {e}"
    ) from None
  if tuple(y.shape) != tuple(expected):
    raise ValueError(
      f"{fn}: `y` has shape {y.shape}, but the convolution of x {x.shape} with kernel "
      f"{kernel.shape} gives {tuple(expected)}; check the strides, padding and layout."
    )
  out = kernel.shape[conv["dimension_numbers"].rhs_spec[0]]
  return _bind_layer(fn, "conv", [y, x, kernel], approx, bias, out, **conv)


def _conv_arguments(fn, x, kernel, spatial, padding, dimension_numbers, groups) -> dict:
  """`conv_general_dilated`'s keyword arguments, checked, padding made explicit."""
  if x.ndim < 3 or kernel.ndim != x.ndim:
    raise ValueError(
      f"{fn}: `x` (shape {x.shape}) and `kernel` (shape {kernel.shape}) must have the same "
      "rank, at least 3 (batch, feature and one or more spatial axes)."
    )
  nsp = x.ndim - 2
  try:
    dn = jax.lax.conv_dimension_numbers(x.shape, kernel.shape, dimension_numbers)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{fn}: bad `dimension_numbers` {dimension_numbers!r}: {e}") from None
  spatial = dict(zip(("window_strides", "lhs_dilation", "rhs_dilation"), spatial))
  for name, value in spatial.items():
    try:
      spatial[name] = tuple(int(v) for v in ((1,) * nsp if value is None else value))
    except TypeError:
      raise TypeError(f"{fn}: `{name}` must be a sequence of ints, got {value!r}.") from None
    if len(spatial[name]) != nsp or min(spatial[name]) < 1:
      raise ValueError(f"{fn}: `{name}` must be {nsp} positive ints, got {value!r}.")
  _checks.static_int(groups, "feature_group_count")
  in_sp = [(x.shape[d] - 1) * s + 1 for d, s in zip(dn.lhs_spec[2:], spatial["lhs_dilation"])]
  win = [(kernel.shape[d] - 1) * s + 1 for d, s in zip(dn.rhs_spec[2:], spatial["rhs_dilation"])]
  try:
    pads = padding
    if isinstance(padding, str):
      pads = jax.lax.padtype_to_pads(in_sp, win, spatial["window_strides"], padding)
    pads = tuple((int(lo), int(hi)) for lo, hi in pads)
  except (TypeError, ValueError, RuntimeError):
    pads = ()
  if len(pads) != nsp:
    raise ValueError(
      f'{fn}: `padding` must be "SAME", "VALID", "SAME_LOWER" or {nsp} (lo, hi) pairs, got '
      f"{padding!r}."
    )
  return dict(spatial, padding=pads, dimension_numbers=dn, feature_group_count=groups)


def register_scale_and_shift(y, x, scale=None, shift=None, approx: str | None = None) -> Array:
  """Tags `y = x * scale + shift` (either parameter optional) as a scale-and-shift layer.

  Args:
    y: the layer output `[batch, ...]`.
    x: the input the scale multiplies (the normalised activations), broadcastable to `y`.
    scale, shift: optional parameter leaves spanning trailing axes of `y` (broadcast over the
      leading ones, as in the affine part of LayerNorm / BatchNorm).
    approx: "full" (default) or "diagonal".

  Returns:
    `y`, unchanged.
  """
  fn = "register_scale_and_shift"
  y, x = _check_array(y, "y", fn), _check_array(x, "x", fn)
  if scale is None and shift is None:
    raise ValueError(f"{fn}: give `scale`, `shift` or both.")
  if y.ndim < 1:
    raise ValueError(f"{fn}: `y` needs a leading batch axis, got shape {y.shape}.")
  try:
    ok = jnp.broadcast_shapes(x.shape, y.shape) == y.shape
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(f"{fn}: `x` of shape {x.shape} does not broadcast to `y` {y.shape}.")
  operands = [y, x]
  for name, p in (("scale", scale), ("shift", shift)):
    if p is None:
      continue
    p = _check_array(p, name, fn)
    core = tuple(itertools.dropwhile(lambda d: d == 1, p.shape))
    if len(core) >= y.ndim or (core and tuple(y.shape[y.ndim - len(core) :]) != core):
      raise ValueError(
        f"{fn}: `{name}` has shape {p.shape}; it must match trailing axes of y {y.shape} "
        "(not the batch axis)."
      )
    operands.append(p)
  has = {"has_scale": scale is not None, "has_shift": shift is not None}
  return _bind_layer(fn, "scale_and_shift", operands, approx, **has)


def register_embedding(y, ids, table, approx: str | None = None) -> Array:
  """Tags `y = table[ids]` as an embedding lookup.

  Args:
    y, ids: the looked-up rows `[*ids.shape, dim]` and the integer ids (leading axis the batch).
    table: `[vocab, dim]` parameter leaf (possibly cast).
    approx: "kron" (the default: diagonal input factor, full output factor).

  Returns:
    `y`, unchanged.
  """
  fn = "register_embedding"
  y, ids, table = (_check_array(v, n, fn) for v, n in ((y, "y"), (ids, "ids"), (table, "table")))
  if table.ndim != 2:
    raise ValueError(f"{fn}: `table` must have shape [vocab, dim], got {table.shape}.")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{fn}: `ids` must be integers, got dtype {ids.dtype}.")
  if ids.ndim < 1 or y.shape != ids.shape + (table.shape[1],):
    raise ValueError(
      f"{fn}: `y` has shape {y.shape}, expected ids.shape + (dim,) = "
      f"{ids.shape + (table.shape[1],)} (ids need a leading batch axis)."
    )
  return _bind_layer(fn, "embedding", [y, ids, table], approx)

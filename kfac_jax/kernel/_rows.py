"""The rows of U: per-example pull-backs of the estimation mode's output vectors, in chunks.

Each loss tag's examples are evaluated one at a time on the registration's graph traced for a
batch of one example, vmapped over a chunk's examples and the mode's vectors, the chunks in a
loop. The vectors come from one full-batch forward pass, drawn as the K-FAC statistics draw them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from kfac_jax import _checks, _curvature, _losses
from kfac_jax import scan as _scan

Array = jax.Array
AxisName = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class TagRows:
  """Where one loss tag's rows sit in U (static): rows `offset + n S_ℓ + s` for its `examples`
  N_ℓ on this device and its `vectors` S_ℓ per example; `kind`, its distribution."""

  kind: str
  examples: int
  vectors: int
  offset: int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
  """The per-example rows of the registration's curvature, `F = UᵀU` (package docstring).

  Attributes:
    matrix: U, `[R, P]` in the params' dtype: row `(ℓ, n, s)` is `J_nᵀ v_s / √(N_ℓ S_ℓ)`, the
      params raveled as `jax.flatten_util.ravel_pytree` orders them, `N_ℓ` over every device;
      under `axis_name`, this device's rows.
    residuals: ε, `[R]` in float32 or wider, with `Uᵀε` the tagged loss's gradient (0 for tags
      without), or None when the loss is not the tags' or no tag gives one.
    example_mismatch: `max |z_n − z[n]| / max |z|` over the tags: each example's prediction
      alone against the batch's; above rounding an output depends on other examples.
    layout: static; one `TagRows` per loss tag, in the registration's order.
    num_devices: static; the size of the axis the rows were computed under (1 without one).
  """

  matrix: Array
  residuals: Array | None
  example_mismatch: Array
  layout: tuple[TagRows, ...] = dataclasses.field(metadata={"static": True})
  num_devices: int = dataclasses.field(default=1, metadata={"static": True})


def axis_size(axis_name: AxisName) -> int:
  """The number of devices along `axis_name` (1 for None)."""
  return 1 if axis_name is None else int(jax.lax.axis_size(axis_name))


def _check_params(leaves) -> Any:
  dtypes = {jnp.result_type(x) for x in leaves}
  bad = [d for d in dtypes if not jnp.issubdtype(d, jnp.floating)]
  if bad or not leaves:
    raise TypeError(
      "the kernel natural gradient needs real floating-point params (a complex log ψ is "
      f"fine, complex params are not); got leaf dtypes {sorted(str(d) for d in dtypes)}."
    )
  return jnp.result_type(*dtypes)


def _tag_values(scan: _scan.ScanResult, p_leaves, b_leaves):
  """Per loss tag, `(prediction, other operands)` from one forward pass of `scan`'s graph."""
  watch = frozenset(a for ops in scan.loss_operands for a in ops if _scan.is_key(a))
  _, seen = scan.graph.evaluate(list(p_leaves) + list(b_leaves), watch=watch)
  read = lambda a: _curvature.read_atom(a, seen)  # noqa: E731
  return [(read(ops[0]), tuple(read(a) for a in ops[1:])) for ops in scan.loss_operands]


def _residual(spec, pred, others, mode: str, vectors: int, scale) -> Array | None:
  """Tag ℓ's ε `[N_ℓ, S_ℓ]` with `Σ_s ε_ns u_ns = ∇_θ` of its mean loss, or None where the mode's
  vectors do not span the gradient (random modes; weights varying within an example)."""
  if not spec.has_targets or mode in _losses.RANDOM_MODES:
    return None
  n = pred.shape[0]
  if mode in _losses.EXACT_MODES:
    # The rows' √K ⊙ (√w ⊙ B e_k) / √(N K): ε_nk = (√w ⊙ e)_k / √N.
    e = _losses.whitened_residual(spec, (pred, *others))
    return e.reshape(n, vectors) * (scale * math.sqrt(vectors))
  dtype = jnp.promote_types(pred.dtype, jnp.float32)
  if not spec.has_weight:  # "empirical": u_n = J_nᵀ √w ∇ℓ_n, so ε_n = √w_n.
    return jnp.full((n, 1), scale, dtype)
  w = others[-1]
  if w.ndim and math.prod(w.shape[1:]) != 1:
    return None
  w = jnp.broadcast_to(jnp.maximum(w.astype(dtype), 0).reshape(-1), (n,))
  return (jnp.sqrt(w) * scale)[:, None]


def _fill_tag_rows(
  u, offset: int, scan1, index: int, p_leaves, template, own, xs, cts, pred, chunk
):
  """U with tag `index`'s rows (from `xs`, the batch leaves at `own`, and `cts [N, S, 1, ...]`)
  written from row `offset` on, and the relative gap of its per-example predictions to `pred`.
  The last chunk ends at example N, overlapping its predecessor, so none is padded or joined."""
  op = scan1.loss_operands[index][0]
  watch = frozenset([op]) if _scan.is_key(op) else frozenset()
  dtype = u.dtype

  def one(ex, vs):
    leaves = list(template)
    for pos, x in zip(own, ex):
      leaves[pos] = x[None]

    def prediction(pl):
      _, seen = scan1.graph.evaluate(list(pl) + leaves, watch=watch)
      return _curvature.read_atom(op, seen)

    z, vjp = jax.vjp(prediction, list(p_leaves))

    def row(v):
      (grads,) = vjp(v.astype(z.dtype))
      return jnp.concatenate([g.reshape(-1).astype(dtype) for g in grads])

    return jax.vmap(row)(vs), z[0]

  n, s = cts.shape[:2]
  chunk = n if chunk is None else min(chunk, n)

  def body(i, carry):
    u, zs = carry
    start = jnp.minimum(i * chunk, n - chunk)
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk)  # noqa: E731
    m, z = jax.vmap(one)([take(x) for x in xs], take(cts))
    u = jax.lax.dynamic_update_slice_in_dim(u, m.reshape(chunk * s, -1), offset + start * s, 0)
    return u, jax.lax.dynamic_update_slice_in_dim(zs, z, start, 0)

  u, z1 = jax.lax.fori_loop(0, -(-n // chunk), body, (u, jnp.zeros_like(pred)))
  zf = pred.astype(jnp.promote_types(pred.dtype, jnp.float32))
  top = jnp.max(jnp.abs(zf))
  err = jnp.max(jnp.abs(z1.astype(zf.dtype) - zf))
  return u, jnp.where(top > 0, err / jnp.where(top > 0, top, 1), err)


def _plan(registration, scan, scan1, values, lead, rng, devices):
  """Per loss tag: `(batch positions of its examples, its scaled vectors [N, S, 1, ...], first
  row)`, its residuals (`_residual`) and its `TagRows`."""
  mode = registration.estimation_mode
  keys = jax.random.split(rng, len(scan.losses)) if rng is not None else [None] * len(values)
  plans, residuals, layout, offset = [], [], [], 0
  for i, (spec, (pred, others), key) in enumerate(zip(scan.losses, values, keys)):
    n = spec.batch_size
    own = [j for j, m in enumerate(lead) if m == n]
    if not own or scan1.losses[i].batch_size != 1:
      raise ValueError(
        f"loss tag #{i} ({spec.kind}, prediction shape {spec.prediction_shape}): no batch leaf "
        f"has its {n} examples on the leading axis (leading sizes {lead}), or its prediction "
        "does not follow them: put them on the leading axis of the leaves it is computed from."
      )
    cts = _losses.output_cotangents(spec, (pred, *others), mode, key, registration.num_samples)
    s = cts.shape[0]
    scale = 1.0 / math.sqrt(n * devices * s)
    cts = jnp.moveaxis(cts * jnp.asarray(scale, cts.dtype), 0, 1)[:, :, None]  # [N, S, 1, ...]
    plans.append((own, cts, offset))
    rscale = jnp.asarray(scale, jnp.promote_types(pred.dtype, jnp.float32))
    residuals.append(
      None if registration.separate_loss else _residual(spec, pred, others, mode, s, rscale)
    )
    layout.append(TagRows(spec.kind, n, s, offset))
    offset += n * s
  return plans, residuals, tuple(layout)


def _centered(u, layout, axis_name):
  """U with each tag's mean row (over its examples on every device) subtracted."""
  for t in layout:
    block = u[t.offset : t.offset + t.examples * t.vectors].reshape(t.examples, t.vectors, -1)
    mean = jnp.mean(block, axis=0, keepdims=True)
    if axis_name is not None:
      mean = jax.lax.pmean(mean, axis_name)
    block = (block - mean).reshape(t.examples * t.vectors, -1)
    u = jax.lax.dynamic_update_slice_in_dim(u, block, t.offset, 0)
  return u


def _joined(residuals, layout) -> Array | None:
  """The tags' residuals as one `[R]` vector (zeros for tags without), or None if none has."""
  if all(e is None for e in residuals):
    return None
  rdtype = jnp.result_type(*(e for e in residuals if e is not None))
  parts = [
    jnp.zeros((t.examples * t.vectors,), rdtype) if e is None else e.reshape(-1)
    for e, t in zip(residuals, layout)
  ]
  return jnp.concatenate(parts).astype(rdtype)


def rows(
  registration,
  params,
  batch,
  rng: Array | None = None,
  *,
  chunk_size: int | None = None,
  axis_name: AxisName = None,
  center: bool = False,
) -> Rows:
  """The rows U (and the residuals ε) of the registration's curvature on `batch`.

  Pure and jit-compatible: call it inside the step, on this device's batch. Each tag's examples
  are the batch leaves whose leading axis has the tag's size N_ℓ.

  Args:
    registration: the `kfac_jax.Registration`.
    params: the parameters, of the registration's signature.
    batch: this device's batch.
    rng: a key for the random estimation modes; the draws are those of
      `kfac_jax.value_and_grad(registration=...)`'s statistics for the same key.
    chunk_size: examples C per chunk of the per-example passes (None: each tag's examples in
      one chunk): their memory is about `C S (2 P b + A)`, b the params' itemsize, A one
      example's activations.
    axis_name: the collective axis the batch is sharded over (pmap / shard_map), which makes
      `N_ℓ` the examples over every device; None under plain jit.
    center: subtract from each tag's rows their mean over its examples (every device's): the
      scores' covariance (stochastic reconfiguration's metric), with no residuals.

  Returns:
    A `Rows`.

  Raises:
    TypeError / ValueError: a bad argument, named with its value; a loss tag whose examples
      no batch leaf holds (its prediction does not come from a batch leaf of its leading size).
  """
  if chunk_size is not None:
    _checks.static_int(chunk_size, "chunk_size")
  _curvature.check_rng(registration.estimation_mode, rng)
  registration.check_params(params)
  p_leaves = jax.tree_util.tree_leaves(params)
  dtype = _check_params(p_leaves)
  b_leaves, b_def = jax.tree_util.tree_flatten(batch)
  devices = axis_size(axis_name)
  # The graph for the batch, and for a batch of one example of every tag's leaves.
  scan = registration.scan_batch(params, batch, check_layers=False)
  sizes = {spec.batch_size for spec in scan.losses}
  lead = [x.shape[0] if getattr(x, "ndim", 0) else None for x in b_leaves]
  one_batch = [x[:1] if n in sizes else x for x, n in zip(b_leaves, lead)]
  one = jax.tree_util.tree_unflatten(b_def, one_batch)
  scan1 = registration.scan_batch(params, one, check_layers=False)

  values = _tag_values(scan, p_leaves, b_leaves)
  plans, residuals, layout = _plan(registration, scan, scan1, values, lead, rng, devices)
  u = jnp.zeros((sum(t.examples * t.vectors for t in layout), sum(x.size for x in p_leaves)), dtype)
  mismatch = []
  for i, ((own, cts, start), (pred, _)) in enumerate(zip(plans, values)):
    xs = [b_leaves[j] for j in own]
    u, gap = _fill_tag_rows(u, start, scan1, i, p_leaves, one_batch, own, xs, cts, pred, chunk_size)
    mismatch.append(gap)
  if center:
    u, residuals = _centered(u, layout, axis_name), [None] * len(residuals)
  mism = jnp.max(jnp.stack(mismatch))
  if axis_name is not None:
    mism = jax.lax.pmax(mism, axis_name)
  return Rows(u, _joined(residuals, layout), mism, layout, devices)

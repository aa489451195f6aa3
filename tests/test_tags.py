"""Tags are transparent: values and derivatives of tagged functions equal the untagged ones."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax import _tags
from tests import _models


def _model(params, x, tag):
  h = x @ params["w1"] + params["b1"]
  if tag:
    h = kfac_jax.register_dense(h, x, params["w1"], params["b1"])
  h = jnp.tanh(h)
  s = params["s"]
  if tag:
    s = kfac_jax.register_generic(s)
  out = (h * s) @ params["w2"]
  return out


def _loss(params, x, y, tag):
  out = _model(params, x, tag)
  if tag:
    out = kfac_jax.register_softmax_cross_entropy_loss(out, y)
    kfac_jax.register_squared_error_loss(out, jnp.zeros_like(out))
  logp = jax.nn.log_softmax(out)
  return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


@pytest.fixture
def setup():
  rng = _models.np_rng(0)
  params = {
    "w1": rng.standard_normal((4, 6)),
    "b1": np.zeros(6),
    "s": np.ones(6),
    "w2": rng.standard_normal((6, 3)),
  }
  params = jax.device_put({k: v.astype(np.float32) for k, v in params.items()})
  x = _models.normal(1, (8, 4))
  y = _models.integers(2, 0, 3, 8)
  return params, x, y


def _close(a, b):
  for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-6)


def test_jit_and_grad(setup):
  params, x, y = setup
  # The untagged references in one program; the tagged calls under jit and eagerly.
  value, grad = jax.jit(jax.value_and_grad(lambda p: _loss(p, x, y, False)))(params)
  for t in (jax.jit, lambda f: f):
    _close(t(lambda p: _loss(p, x, y, True))(params), value)
    _close(t(jax.grad(lambda p: _loss(p, x, y, True)))(params), grad)


def test_jvp_vjp_and_hessian(setup):
  params, x, y = setup
  tangent = jax.tree_util.tree_map(lambda p: np.ones(p.shape, p.dtype), params)
  jvp = jax.jit(  # One program each: eager operations would compile one by one.
    lambda tag: jax.jvp(lambda p: _loss(p, x, y, tag), (params,), (tangent,)), static_argnums=0
  )
  _close(jvp(True), jvp(False))
  _close(
    _models.jit_hessian(lambda w: _loss({**params, "w2": w}, x, y, True))(params["w2"]),
    _models.jit_hessian(lambda w: _loss({**params, "w2": w}, x, y, False))(params["w2"]),
  )


def test_vmap(setup):
  params, x, y = setup
  # One program per side: eager operations would compile one by one.
  f = jax.jit(
    lambda tag: jax.vmap(lambda xi, yi: _loss(params, xi[None], yi[None], tag))(x, y),
    static_argnums=0,
  )
  _close(f(True), f(False))
  grads = jax.jit(
    lambda tag: jax.vmap(
      jax.grad(lambda p, xi, yi: _loss(p, xi[None], yi[None], tag)), in_axes=(None, 0, 0)
    )(params, x, y),
    static_argnums=0,
  )
  _close(grads(True), grads(False))


def test_checkpoint(setup):
  params, x, y = setup
  f = lambda tag: jax.grad(jax.checkpoint(lambda p: _loss(p, x, y, tag)))(params)
  _close(jax.jit(lambda: f(True))(), jax.jit(lambda: f(False))())


def test_scan(setup):
  params, x, y = setup

  def total(p, tag):
    def body(c, xy):
      xi, yi = xy
      return c + _loss(p, xi, yi, tag), None

    return jax.lax.scan(body, 0.0, (x.reshape(2, 4, 4), y.reshape(2, 4)))[0]

  _close(
    jax.jit(jax.value_and_grad(lambda p: total(p, True)))(params),
    jax.jit(jax.value_and_grad(lambda p: total(p, False)))(params),
  )


def test_pmap(setup):
  params, x, y = setup
  n = jax.local_device_count()
  assert n == 8, "conftest should provide 8 CPU devices"
  xs, ys = x.reshape(n, 1, 4), y.reshape(n, 1)
  f = lambda tag: jax.pmap(jax.grad(lambda p, xi, yi: _loss(p, xi, yi, tag)), in_axes=(None, 0, 0))(
    params, xs, ys
  )
  _close(f(True), f(False))


def test_tags_lower_to_nothing(setup):
  """The traced program holds the tags; the lowered one is the untagged program, op for op."""
  params, x, y = setup
  traced = {e.primitive for e in jax.make_jaxpr(lambda p: _loss(p, x, y, True))(params).eqns}
  assert {_tags.loss_tag_p, _tags.layer_tag_p} <= traced
  tagged = jax.jit(lambda p: _loss(p, x, y, True)).lower(params).as_text(debug_info=False)
  plain = jax.jit(lambda p: _loss(p, x, y, False)).lower(params).as_text(debug_info=False)
  assert tagged == plain


def test_tags_return_their_first_argument(setup):
  params, x, y = setup
  logits = _model(params, x, False)
  assert kfac_jax.register_softmax_cross_entropy_loss(logits, y) is not None
  np.testing.assert_array_equal(kfac_jax.register_softmax_cross_entropy_loss(logits, y), logits)
  np.testing.assert_array_equal(
    kfac_jax.register_sigmoid_cross_entropy_loss(logits, logits > 0), logits
  )
  tree = {"a": jnp.ones(3), "b": jnp.zeros((2, 2))}
  _close(kfac_jax.register_generic(tree), tree)


@pytest.mark.parametrize(
  "call, match",
  [
    (
      lambda: kfac_jax.register_softmax_cross_entropy_loss(jnp.ones((4, 3)), jnp.ones((5,), int)),
      "targets",
    ),
    (
      lambda: kfac_jax.register_softmax_cross_entropy_loss(jnp.ones((4, 3)), jnp.ones((4,))),
      "integers",
    ),
    (lambda: kfac_jax.register_softmax_cross_entropy_loss(jnp.ones((4,))), "num_classes"),
    (lambda: kfac_jax.register_squared_error_loss(jnp.ones((4, 2), int)), "floating"),
    (lambda: kfac_jax.register_normal_predictive_distribution(jnp.ones((4, 2)), var=-1.0), "var"),
    (
      lambda: kfac_jax.register_squared_error_loss(jnp.ones((4, 2)), weight=jnp.ones((3,))),
      "weight",
    ),
    (
      lambda: kfac_jax.register_dense(jnp.ones((2, 3)), jnp.ones((2, 4)), jnp.ones((5, 3))),
      "does not match `kernel`",
    ),
    (
      lambda: kfac_jax.register_dense(jnp.ones((2, 4)), jnp.ones((2, 4)), jnp.ones((4, 3))),
      "`y` has shape",
    ),
    (
      lambda: kfac_jax.register_dense(
        jnp.ones((2, 3)), jnp.ones((2, 4)), jnp.ones((4, 3)), jnp.ones((4,))
      ),
      "`bias` has shape",
    ),
    (
      lambda: kfac_jax.register_dense(
        jnp.ones((2, 3)), jnp.ones((2, 4)), jnp.ones((4, 3)), approx=3
      ),
      "approx",
    ),
    (lambda: kfac_jax.register_generic({}), "no array leaves"),
  ],
)
def test_bad_tag_calls(call, match):
  with pytest.raises((ValueError, TypeError), match=match):
    call()


# -- the `weight` of a loss tag: shapes and meaning (the _tags module docstring) ---------------

WN, WD, WK = 4, 3, 3
WEIGHT_CASES = [
  ("categorical", ()),  # a scalar
  ("categorical", (WN,)),  # per example
  ("bernoulli", (WN, 1)),  # per example
  ("bernoulli", (WN, WK)),  # per unit
  ("normal", (1, WK)),  # per coordinate, the same for every example
  ("normal", (WN, WK)),  # per example and coordinate
]


def _weighted_nll(kind, z, b):
  """The unweighted negative log-likelihood per event entry (`[N]` or `[N, K]`)."""
  if kind == "categorical":
    return -jnp.take_along_axis(jax.nn.log_softmax(z), b["y"][:, None], 1)[:, 0]
  if kind == "bernoulli":
    return jnp.logaddexp(0, z) - b["t"] * z
  return (z - b["t"]) ** 2 / (2 * 0.3)


def _weight_setup(kind, wshape):
  rng = _models.np_rng(5)  # float64 throughout: every caller runs under x64.
  params = jax.device_put({"w": rng.standard_normal((WD, WK)), "b": 0.3 * rng.standard_normal(WK)})
  batch = {
    "x": rng.standard_normal((WN, WD)),
    "y": np.arange(WN) % WK,
    "t": (rng.random((WN, WK)) > 0.5).astype(np.float64),
    "w": rng.uniform(0.2, 3.0, wshape),
  }
  if kind == "normal":
    batch["t"] = rng.standard_normal((WN, WK))
  batch = jax.device_put(batch)

  def loss_fn(p, b):
    z = b["x"] @ p["w"] + p["b"]
    if kind == "categorical":
      kfac_jax.register_softmax_cross_entropy_loss(z, b["y"], weight=b["w"])
      return jnp.mean(b["w"] * _weighted_nll(kind, z, b))
    if kind == "bernoulli":
      kfac_jax.register_sigmoid_cross_entropy_loss(z, b["t"], weight=b["w"])
    else:
      kfac_jax.register_normal_predictive_distribution(z, b["t"], var=0.3, weight=b["w"])
    return jnp.mean(jnp.sum(b["w"] * _weighted_nll(kind, z, b), -1))

  return loss_fn, params, batch


@pytest.mark.parametrize("mode", ["exact", "exact_GGN", "empirical"])
@pytest.mark.parametrize("kind, wshape", WEIGHT_CASES)
def test_weight_is_a_multiplicity_in_every_mode(x64, kind, wshape, mode):
  """A weight counts an entry `w` times, linearly, against the definitions in float64:
  the Fisher / GGN modes give `Jᵀ H J` with H the Hessian of the weighted loss
  `(1/N) Σ w ℓ` in the prediction; "empirical" gives `(1/N) Σₙ uₙ uₙᵀ` with
  `uₙ = Σ_k √w_nk ∇_θ ℓ_nk`, the unweighted per-entry gradients (for a weight per example,
  `w ∇ℓ ∇ℓᵀ`, not the `w²` of the weighted loss's gradients). The dense layer's block is
  "full", so the block is the whole curvature of its parameters."""
  from jax.flatten_util import ravel_pytree

  loss_fn, params, batch = _weight_setup(kind, wshape)
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn,
      params,
      batch,
      estimation_mode=mode,
      layers=kfac_jax.LayerConfig(defaults={"dense": "full"}),
    )
  )
  state = jax.jit(  # One program: eager operations would compile one by one.
    lambda p, b: est.update_curvature(est.init(p), p, b, None, ema_decay=0.0)
  )(params, batch)
  dense = np.asarray(est.to_dense(state))

  flat, unravel = ravel_pytree(params)
  apply = lambda v: batch["x"] @ unravel(v)["w"] + unravel(v)["b"]  # noqa: E731
  z = jax.jit(apply)(flat)
  if mode == "empirical":
    per_entry = _models.jit_jacobian(lambda v: _weighted_nll(kind, apply(v), batch))(flat)
    w = np.broadcast_to(np.asarray(batch["w"]), per_entry.shape[:-1])
    grads = np.asarray(per_entry)  # [N, P] or [N, K, P]: ∇_θ ℓ per entry, unweighted.
    u = grads * np.sqrt(w)[..., None]
    u = u if u.ndim == 2 else u.sum(1)
    reference = u.T @ u / WN
  else:
    jac = np.asarray(_models.jit_jacobian(apply)(flat)).reshape(z.size, -1)
    tagged = lambda zz: jnp.mean(  # noqa: E731
      jnp.reshape(batch["w"] * _weighted_nll(kind, zz, batch), (WN, -1)).sum(-1)
    )
    hess = np.asarray(_models.jit_hessian(tagged)(z)).reshape(z.size, z.size)
    reference = jac.T @ hess @ jac
  np.testing.assert_allclose(dense, reference, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize(
  "shape, wshape",
  [((4, 4), (4,)), ((4, 3), (4,)), ((4, 3), (3,)), ((4, 2, 3), (4, 2)), ((4, 3), (2, 3))],
)
def test_weight_shapes_are_checked_axis_by_axis(shape, wshape):
  """A weight of lower rank than the event would broadcast against the trailing axes (a
  per-example [N] against [N, N] units silently weighs the units): it is an error naming the
  per-example shape."""
  per_example = (shape[0],) + (1,) * (len(shape) - 1)
  with pytest.raises(ValueError, match=re.escape(f"{per_example} for a weight per example")):
    kfac_jax.register_sigmoid_cross_entropy_loss(jnp.zeros(shape), weight=jnp.ones(wshape))
  kfac_jax.register_sigmoid_cross_entropy_loss(jnp.zeros(shape), weight=jnp.ones(per_example))
  kfac_jax.register_sigmoid_cross_entropy_loss(jnp.zeros(shape), weight=2.0)

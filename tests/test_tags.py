"""Tags are transparent: values and derivatives of tagged functions equal the untagged ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax import _tags


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
  k = jax.random.split(jax.random.key(0), 4)
  params = {
    "w1": jax.random.normal(k[0], (4, 6)),
    "b1": jnp.zeros((6,)),
    "s": jnp.ones((6,)),
    "w2": jax.random.normal(k[1], (6, 3)),
  }
  x = jax.random.normal(k[2], (8, 4))
  y = jax.random.randint(k[3], (8,), 0, 3)
  return params, x, y


def _close(a, b):
  for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-6)


def test_jit_and_grad(setup):
  params, x, y = setup
  for t in (jax.jit, lambda f: f):
    _close(t(lambda p: _loss(p, x, y, True))(params), _loss(params, x, y, False))
    _close(
      t(jax.grad(lambda p: _loss(p, x, y, True)))(params),
      jax.grad(lambda p: _loss(p, x, y, False))(params),
    )


def test_jvp_vjp_and_hessian(setup):
  params, x, y = setup
  tangent = jax.tree_util.tree_map(jnp.ones_like, params)
  a = jax.jvp(lambda p: _loss(p, x, y, True), (params,), (tangent,))
  b = jax.jvp(lambda p: _loss(p, x, y, False), (params,), (tangent,))
  _close(a, b)
  _close(
    jax.hessian(lambda w: _loss({**params, "w2": w}, x, y, True))(params["w2"]),
    jax.hessian(lambda w: _loss({**params, "w2": w}, x, y, False))(params["w2"]),
  )


def test_vmap(setup):
  params, x, y = setup
  f = lambda tag: jax.vmap(lambda xi, yi: _loss(params, xi[None], yi[None], tag))(x, y)
  _close(f(True), f(False))
  _close(
    jax.vmap(jax.grad(lambda p, xi, yi: _loss(p, xi[None], yi[None], True)), in_axes=(None, 0, 0))(
      params, x, y
    ),
    jax.vmap(jax.grad(lambda p, xi, yi: _loss(p, xi[None], yi[None], False)), in_axes=(None, 0, 0))(
      params, x, y
    ),
  )


def test_checkpoint(setup):
  params, x, y = setup
  f = lambda tag: jax.grad(jax.checkpoint(lambda p: _loss(p, x, y, tag)))(params)
  _close(jax.jit(lambda: f(True))(), f(False))


def test_scan(setup):
  params, x, y = setup

  def total(p, tag):
    def body(c, xy):
      xi, yi = xy
      return c + _loss(p, xi, yi, tag), None

    return jax.lax.scan(body, 0.0, (x.reshape(2, 4, 4), y.reshape(2, 4)))[0]

  _close(
    jax.jit(jax.value_and_grad(lambda p: total(p, True)))(params),
    jax.value_and_grad(lambda p: total(p, False))(params),
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

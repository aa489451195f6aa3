"""A user's own curvature block for a layer (`LayerConfig.blocks`): used by every front, giving
the exact preconditioned update of the block it computes, and checked before any state."""

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _models

N, D, H, K = 6, 3, 4, 2
DAMPING = 1e-2


class _F(NamedTuple):
  f: jax.Array  # [n, n]


class _C(NamedTuple):
  inv: jax.Array  # [n, n]
  damping: jax.Array  # []


class FullFisher(kfac_jax.Block):
  """The exact Fisher block over the layer's parameters, inverted with its damping."""

  @classmethod
  def factor_shapes_for(cls, spec):
    return ((spec.num_params, spec.num_params),)

  def init_factors(self):
    n = self.spec.num_params
    return _F(jnp.zeros((n, n), self.config.stats_dtype))

  def batch_factors(self, data, batch_size, cache=None):
    h, c = self.gradient_rows(data, batch_size)
    return _F(h.T @ h / c)

  def init_cache(self):
    n, dtype = self.spec.num_params, self.config.inverse_dtype
    return _C(jnp.eye(n, dtype=dtype), jnp.zeros((), dtype))

  def compute_cache(self, factors, damping):
    damping = jnp.asarray(damping, self.config.inverse_dtype)
    eye = jnp.eye(self.spec.num_params, dtype=self.config.inverse_dtype)
    return _C(jnp.linalg.inv(factors.f + damping * eye), damping)

  def multiply_matpower(self, factors, cache, vecs, exp):
    v = jnp.concatenate([jnp.ravel(x) for x in vecs])
    out = factors.f @ v + cache.damping * v if exp == 1 else cache.inv @ v
    sizes = np.cumsum([x.size for x in vecs])[:-1]
    return [p.reshape(x.shape) for p, x in zip(jnp.split(out, sizes), vecs)]


def _model(p, x):
  return jnp.tanh(x @ p["hidden"]["w"] + p["hidden"]["b"]) @ p["out"]["w"]


def _loss(p, b):
  z = _model(p, b["x"])
  kfac_jax.register_normal_predictive_distribution(z, b["y"])
  return jnp.mean(jnp.sum((z - b["y"]) ** 2, axis=-1))


def _data():
  f = jax.dtypes.canonicalize_dtype(float)  # float64 under x64.
  params = {
    "hidden": {"w": _models.normal(0, (D, H), f), "b": _models.normal(1, (H,), f, scale=0.1)},
    "out": {"w": _models.normal(2, (H, K), f)},
  }
  batch = {"x": _models.normal(3, (N, D), f), "y": _models.normal(4, (N, K), f)}
  return params, batch


@jax.jit
def _expected(params, batch, grads):
  """(F_hidden + λ)⁻¹ g on the hidden layer's leaves, F its exact Fisher block from
  jax.jacobian (the loss's Hessian in the outputs pulled back); the output layer's block
  untouched by the user's pattern is the library's own."""
  flat, unravel = jax.flatten_util.ravel_pytree(params["hidden"])
  z = lambda v: _model({**params, "hidden": unravel(v)}, batch["x"]).ravel()  # noqa: E731
  j = _models.jit_jacobian(z)(flat)
  hz = _models.jit_hessian(lambda z: jnp.mean(jnp.sum((z.reshape(N, K) - batch["y"]) ** 2, -1)))(
    _model(params, batch["x"]).ravel()
  )
  f = j.T @ hz @ j
  g, _ = jax.flatten_util.ravel_pytree(grads["hidden"])
  return unravel(jnp.linalg.solve(f + DAMPING * jnp.eye(len(flat)), g))


def _close(a, b, tol=1e-10):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def test_user_block_gives_the_exact_update_in_every_front(x64):
  params, batch = _data()
  layers = kfac_jax.LayerConfig(blocks={"hidden/*": FullFisher})
  reg = kfac_jax.Registration(_loss, params, batch, layers=layers, estimation_mode="exact")
  assert [s.block for s in reg.layers] == [FullFisher, None]
  assert "FullFisher" in kfac_jax.summary(registration=reg)
  _, grads, stats = jax.jit(kfac_jax.value_and_grad(registration=reg))(params, batch)
  want = _expected(params, batch, grads)
  kw = dict(damping=DAMPING, ema_decay=0.0, inverse_every=1)
  lr = 0.1
  opt = kfac_jax.Optimizer(
    registration=reg, learning_rate=lr, momentum=0.0, use_adaptive_damping=False, **kw
  )
  fronts = [
    kfac_jax.scale_by_kfac(registration=reg, **kw),
    kfac_jax.kfac(registration=reg, learning_rate=lr, momentum=None, max_norm=None, **kw),
    opt.as_optax(),
  ]

  @jax.jit
  def updates():
    init = [tx.init(params) for tx in fronts]
    return [
      tx.update(grads, s, params, curvature_stats=stats)[0] for tx, s in zip(fronts[:2], init)
    ] + [fronts[2].update(grads, init[2], params, batch=batch, rng=jax.random.key(0))[0]]

  preconditioned, chained, optimizer = updates()
  _close(preconditioned["hidden"], want)
  _close(chained["hidden"], jax.tree_util.tree_map(lambda v: -lr * v, want))
  _close(optimizer["hidden"], jax.tree_util.tree_map(lambda v: -lr * v, want))
  # Not what the library's own (Kronecker) block gives.
  plain = kfac_jax.Registration(_loss, params, batch, estimation_mode="exact")
  tx0 = kfac_jax.scale_by_kfac(registration=plain, **kw)
  u0, _ = jax.jit(tx0.update)(grads, tx0.init(params), params, curvature_stats=stats)
  assert np.abs(np.asarray(u0["hidden"]["w"] - want["w"])).max() > 1e-3


def test_user_block_on_parameters_no_layer_covers(x64):
  """A pattern naming a parameter the scanner leaves to the fallback: that leaf gets the
  user's block, without the uncovered-parameters warning."""
  params, batch = _data()
  params = {**params, "scale": jnp.full((K,), 1.5)}

  def loss_fn(p, b):
    z = _model(p, b["x"]) * jnp.sin(p["scale"])  # No layer pattern: the fallback's.
    kfac_jax.register_normal_predictive_distribution(z, b["y"])
    return jnp.mean(jnp.sum((z - b["y"]) ** 2, axis=-1))

  layers = kfac_jax.LayerConfig(blocks={"scale": FullFisher})
  with pytest.warns(kfac_jax.UncoveredParametersWarning):
    kfac_jax.Registration(loss_fn, params, batch)
  with warnings.catch_warnings():
    warnings.simplefilter("error", kfac_jax.UncoveredParametersWarning)
    reg = kfac_jax.Registration(
      loss_fn, params, batch, layers=layers, estimation_mode="exact", num_samples=1
    )
  (spec,) = [s for s in reg.layers if s.param_paths == ("scale",)]
  assert spec.block is FullFisher and spec.source == "config"
  tx = kfac_jax.scale_by_kfac(registration=reg, damping=DAMPING, ema_decay=0.0, inverse_every=1)

  @jax.jit
  def step():
    _, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch)
    return grads, *tx.update(grads, tx.init(params), params, curvature_stats=stats)

  grads, updates, state = step()
  f = np.asarray(state.curvature.factors[spec.name].f)
  assert f.shape == (K, K) and np.abs(f).max() > 0
  want = np.linalg.solve(f + DAMPING * np.eye(K), grads["scale"])
  _close(updates["scale"], want)


class _Abstract(kfac_jax.Block):
  @classmethod
  def factor_shapes_for(cls, spec):
    return ()


class _WrongProduct(FullFisher):
  def multiply_matpower(self, factors, cache, vecs, exp):
    return [jnp.zeros(3)]


class _WrongStats(FullFisher):
  def batch_factors(self, data, batch_size, cache=None):
    return _F(jnp.zeros((2, 2)))


class _NoShapes(FullFisher):
  @classmethod
  def factor_shapes_for(cls, spec):
    return None


class _NaNCache(FullFisher):
  """A refresh that is never finite: the layer keeps its first (identity) cache."""

  def compute_cache(self, factors, damping):
    cache = super().compute_cache(factors, damping)
    return cache._replace(inv=cache.inv * jnp.nan)


def test_a_user_block_whose_refresh_is_not_finite_is_reported_once_by_name():
  """Its layer keeps the identity cache (the plain gradient), `failed_inverses` counts every
  failed refresh, and the front warns once, from the host, naming the layer and its class; the
  library's block on the other layer refreshes normally."""
  params, batch = _data()
  reg = kfac_jax.Registration(
    _loss, params, batch, layers=kfac_jax.LayerConfig(blocks={"hidden/*": _NaNCache})
  )
  tx = kfac_jax.kfac(
    registration=reg,
    learning_rate=0.1,
    momentum=None,
    max_norm=None,
    inverse_every=1,
    config=kfac_jax.Config(step_warnings=True),
  )

  @jax.jit
  def step(params, state, rng):
    _, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state, grads, updates

  state = jax.jit(tx.init)(params)
  with pytest.warns(kfac_jax.FailedInverseWarning) as record:
    for i in range(3):
      params, state, grads, updates = step(params, state, jax.random.key(i))
  messages = [str(w.message) for w in record]
  assert len(messages) == 1, messages
  assert "inverse of `hidden` (_NaNCache) was not finite at step 0" in messages[0]
  assert "failed_inverses" in messages[0] and "`out`" not in messages[0]
  assert int(state.preconditioner.curvature.failed_inverses) == 3
  _close(updates["hidden"], jax.tree_util.tree_map(lambda g: -0.1 * g, grads["hidden"]), 1e-6)
  assert np.isfinite(np.asarray(state.preconditioner.curvature.cache["out"].g.powers[0])).all()


def test_bad_blocks_are_named_before_any_state():
  params, batch = _data()
  with pytest.raises(TypeError, match=r"LayerConfig.blocks\['hidden/\*'\] must be a subclass"):
    kfac_jax.LayerConfig(blocks={"hidden/*": "full"})
  with pytest.raises(TypeError, match=r"LayerConfig.blocks\['hidden/\*'\] must be a subclass"):
    kfac_jax.Registration(
      _loss, params, batch, layers=kfac_jax.LayerConfig(blocks={"hidden/*": int})
    )
  with pytest.raises(TypeError, match=r"_Abstract does not implement \['batch_factors'"):
    kfac_jax.Registration(
      _loss, params, batch, layers=kfac_jax.LayerConfig(blocks={"hidden/*": _Abstract})
    )
  with pytest.raises(kfac_jax.RegistrationError, match=r"_NoShapes.factor_shapes_for returns N"):
    kfac_jax.Registration(
      _loss, params, batch, layers=kfac_jax.LayerConfig(blocks={"hidden/*": _NoShapes})
    )
  with pytest.raises(kfac_jax.RegistrationError, match=r"blocks: pattern 'nothing/\*' matches"):
    kfac_jax.Registration(
      _loss, params, batch, layers=kfac_jax.LayerConfig(blocks={"nothing/*": FullFisher})
    )
  reg = kfac_jax.Registration(
    _loss, params, batch, layers=kfac_jax.LayerConfig(blocks={"hidden/*": _WrongProduct})
  )
  tx = kfac_jax.scale_by_kfac(registration=reg)
  with pytest.raises(ValueError, match=r"layer `hidden`: the block _WrongProduct .* exp=1"):
    tx.init(params)
  reg = kfac_jax.Registration(
    _loss, params, batch, layers=kfac_jax.LayerConfig(blocks={"hidden/*": _WrongStats})
  )
  tx = kfac_jax.scale_by_kfac(registration=reg)

  def step():
    _, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch, jax.random.key(0))
    return tx.update(grads, tx.init(params), params, curvature_stats=stats)

  with pytest.raises(ValueError, match=r"layer `hidden`: batch_factors of the block _WrongSt"):
    jax.eval_shape(step)


def test_user_block_on_a_scanned_stack(x64):
  """A stack of layers sliced by a scan: the user's block is vmapped over the layers, and
  equals the library's "full" block layer by layer."""
  n_layers = 3
  params = {
    "stack": {"w": _models.normal(10, (n_layers, H, H), jnp.float64, scale=0.5)},
    "out": {"w": _models.normal(11, (H, K), jnp.float64)},
  }
  batch = {"x": _models.normal(12, (N, H), jnp.float64), "y": jnp.zeros((N, K))}

  def loss_fn(p, b):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), b["x"], p["stack"]["w"])
    z = h @ p["out"]["w"]
    kfac_jax.register_normal_predictive_distribution(z, b["y"])
    return jnp.mean(jnp.sum((z - b["y"]) ** 2, -1))

  out = []
  for layers in ({"blocks": {"stack/*": FullFisher}}, {"overrides": {"stack/*": "full"}}):
    reg = kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="exact", layers=kfac_jax.LayerConfig(**layers)
    )
    tx = kfac_jax.scale_by_kfac(registration=reg, damping=DAMPING, ema_decay=0.0, inverse_every=1)

    @jax.jit
    def step(reg=reg, tx=tx):
      _, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch)
      return tx.update(grads, tx.init(params), params, curvature_stats=stats)[0]

    out.append(step()["stack"])
    (stack,) = [s for s in reg.layers if s.name == "stack"]
    assert stack.stack_size == n_layers
    assert stack.block is (FullFisher if "blocks" in layers else None)
  _close(out[0], out[1])


def test_blocks_of_two_classes_are_not_batched_together():
  """Equal factor shapes and a shared class name: still two groups (one `compute_cache` call
  per class), so neither layer is refreshed by the other's rule."""
  params = {
    "hidden": {"w": _models.normal(50, (H, H))},
    "out": {"w": _models.normal(51, (H, H))},
  }
  batch = {"x": _models.normal(52, (N, H)), "y": jnp.zeros((N, H))}

  def loss_fn(p, b):
    z = jnp.tanh(b["x"] @ p["hidden"]["w"]) @ p["out"]["w"]
    kfac_jax.register_normal_predictive_distribution(z, b["y"])
    return jnp.mean(jnp.sum((z - b["y"]) ** 2, axis=-1))

  other = type("FullFisher", (FullFisher,), {})
  layers = kfac_jax.LayerConfig(blocks={"hidden/*": FullFisher, "out/*": other})
  reg = kfac_jax.Registration(loss_fn, params, batch, layers=layers)
  a, b = kfac_jax.CurvatureEstimator(reg).blocks
  assert (type(a), type(b)) == (FullFisher, other) and a.factor_shapes == b.factor_shapes
  assert a.group_key() != b.group_key()

"""The library's own code never relies on implicit rank promotion or dtype surprises."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax


@pytest.fixture
def strict_rank():
  prev = jax.config.jax_numpy_rank_promotion
  jax.config.update("jax_numpy_rank_promotion", "raise")
  try:
    yield
  finally:
    jax.config.update("jax_numpy_rank_promotion", prev)


@pytest.mark.parametrize("loss", ["softmax", "sigmoid", "squared"])
@pytest.mark.parametrize(
  "mode, damping_mode",
  [
    ("gradients", "factored"),
    ("empirical", "eigen"),
    ("curvature_prop", "eigen"),
    ("exact", "factored"),
  ],
)
def test_full_step_under_rank_promotion_raise(strict_rank, loss, mode, damping_mode):
  k = jax.random.split(jax.random.key(0), 3)
  params = {"w": jax.random.normal(k[0], (4, 3)), "b": jnp.zeros((3,)), "s": jnp.ones((3,))}
  x = jax.random.normal(k[1], (6, 5, 4))  # Leading batch and time axes.
  y = jax.random.randint(k[2], (6, 5), 0, 3)
  t = jax.nn.one_hot(y, 3)

  def loss_fn(p, b):
    z = (b["x"] @ p["w"] + p["b"][None, None, :]) * (p["s"] ** 2)[None, None, :]
    w = jnp.full((6, 5), 0.2)
    if loss == "softmax":
      kfac_jax.register_softmax_cross_entropy_loss(z, b["y"], weight=w)
      return 0.2 * optax.softmax_cross_entropy_with_integer_labels(z, b["y"]).sum(-1).mean()
    if loss == "sigmoid":
      kfac_jax.register_sigmoid_cross_entropy_loss(z, b["t"], weight=w[..., None])
      return 0.2 * optax.sigmoid_binary_cross_entropy(z, b["t"]).sum((-2, -1)).mean()
    kfac_jax.register_squared_error_loss(z, b["t"])
    return ((z - b["t"]) ** 2).sum((-2, -1)).mean()

  batch = {"x": x, "y": y, "t": t}
  num_samples = 1 if mode == "exact" else 2
  with pytest.warns(kfac_jax.UncoveredParametersWarning, match="`s`"):
    tx = kfac_jax.kfac(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode=mode, num_samples=num_samples
      ),
      learning_rate=0.1,
      config=kfac_jax.Config(damping_mode=damping_mode),
    )
    state = tx.init(params)

  @jax.jit
  def step(params, state, rng):
    loss, grads, stats = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode=mode, num_samples=num_samples
      )
    )(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  for i in range(2):
    params, state, loss = step(params, state, jax.random.key(i))
  assert np.isfinite(float(loss))
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree_util.tree_leaves(params))

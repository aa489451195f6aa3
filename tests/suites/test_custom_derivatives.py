"""Custom derivatives are the user's: the gradient K-FAC returns is `jax.grad`'s for losses
with `jax.custom_jvp` / `jax.custom_vjp` inside, and loss tags in a custom_jvp rule (FermiNet's
variational Monte Carlo loss) define the curvature exactly as a separate curvature function."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _models, _zoo

N, D, H = 12, 3, 5
pytestmark = pytest.mark.filterwarnings("ignore::kfac_jax.UncoveredParametersWarning")


def _close(a, b, tol=1e-10):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@jax.custom_jvp
def _ste_round(w):
  """Quantised weights; the derivative passes straight through."""
  return jnp.round(w * 4) / 4


_ste_round.defjvp(lambda p, t: (_ste_round(p[0]), t[0]))


@jax.custom_vjp
def _reversed_dense(w, x):
  """A dense layer whose backward pass reverses the gradient."""
  return jnp.tanh(x @ w)


def _rev_fwd(w, x):
  return _reversed_dense(w, x), (w, x)


def _rev_bwd(res, ct):
  w, x = res
  g = ct * (1 - jnp.tanh(x @ w) ** 2)
  return -(x.T @ g), -(g @ w.T)


_reversed_dense.defvjp(_rev_fwd, _rev_bwd)


def _normal(seed, shape, scale=1.0):
  """Drawn on the host; float64 under x64, float32 otherwise (`jax.device_put` converts)."""
  return _models.normal(seed, shape, jnp.float64, scale)


def _classifier_data():
  params = {"w1": _normal(0, (D, H)), "w2": _normal(1, (H, H)), "w3": _normal(2, (H, 3))}
  batch = {"x": _normal(3, (N, D)), "y": _models.integers(4, 0, 3, (N,))}
  return params, batch


def _classifier(p, b):
  h = jnp.tanh(b["x"] @ _ste_round(p["w1"]))
  h = _reversed_dense(p["w2"], h)
  logits = h @ p["w3"]
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def test_straight_through_and_gradient_reversal_keep_their_gradient(x64):
  params, batch = _classifier_data()

  @jax.jit  # One program: run eagerly, each op of the loss compiles its own.
  def run(params, batch):
    got = kfac_jax.value_and_grad(_classifier)(params, batch, jax.random.key(1))
    return got, jax.value_and_grad(_classifier)(params, batch)

  (loss, grads, stats), (want_loss, want) = run(params, batch)
  _close(loss, want_loss)
  _close(grads, want)
  # w2's dense layer sits inside the custom_vjp: found, and its statistics taken inside.
  assert "w2" in stats.layer_names
  assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(stats.data))
  assert np.abs(np.asarray(stats.data[1][1])).max() > 0


# -- variational Monte Carlo: a hydrogen-like atom with a small network ---------------------


def _log_psi_one(p, r):
  h = jnp.tanh(r @ p["w1"] + p["b1"])
  return h @ p["w2"] - p["a"][0] * jnp.sqrt(jnp.sum(r**2) + 1e-2)


_log_psi = jax.vmap(_log_psi_one, (None, 0))


def _local_energy(p, r):
  def one(r):
    g = jax.grad(_log_psi_one, 1)(p, r)
    lap = jnp.trace(_models.jit_hessian(_log_psi_one, 1)(p, r))
    return -0.5 * (lap + g @ g) - 1.0 / jnp.sqrt(jnp.sum(r**2) + 1e-2)

  return jax.vmap(one)(r)


def _energy_rule(tag: bool):
  @jax.custom_jvp
  def energy(p, r):
    return jnp.mean(_local_energy(p, r))

  @energy.defjvp
  def energy_jvp(primals, tangents):
    p, r = primals
    e_l = _local_energy(p, r)
    e = jnp.mean(e_l)
    lp, dlp = jax.jvp(lambda q: _log_psi(q, r), (p,), (tangents[0],))
    if tag:  # FermiNet's form: the curvature's tag inside the rule.
      kfac_jax.register_normal_predictive_distribution(lp[:, None])
    return e, 2.0 * jnp.mean((e_l - e) * dlp)

  return lambda p, b: energy(p, b["r"])


def _log_psi_tagged(p, b):
  kfac_jax.register_normal_predictive_distribution(_log_psi(p, b["r"])[:, None])


def _vmc_data():
  params = {
    "w1": _normal(20, (D, H), 0.5),
    "b1": jax.device_put(np.zeros(H)),
    "w2": _normal(21, (H,), 0.5),
    "a": jax.device_put(np.ones(1)),
  }
  return params, {"r": _normal(22, (N, D))}


def test_vmc_energy_gradient_is_the_rule(x64):
  params, batch = _vmc_data()
  loss_fn = _energy_rule(tag=True)
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact")
  assert reg.separate_loss and [s.name for s in reg.layers][:2] == ["a", "w1"]

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def run(params, batch):
    loss, grads, _ = kfac_jax.value_and_grad(registration=reg)(params, batch)
    # The primal's gradient differentiates the Laplacian.
    primal = jax.grad(lambda p, b: jnp.mean(_local_energy(p, b["r"])))(params, batch)
    return (loss, grads), jax.value_and_grad(loss_fn)(params, batch), primal

  (loss, grads), (want_loss, want), primal = run(params, batch)
  _close(loss, want_loss)
  _close(grads, want)
  # The rule's gradient, not the primal's.
  assert np.abs(np.asarray(primal["w1"] - grads["w1"])).max() > 1e-3


def test_tag_in_rule_equals_curvature_fn(x64):
  """The preconditioned update with the tag in the rule equals the one with the same tag in a
  separate `curvature_fn`, for `scale_by_kfac` and the `Optimizer`."""
  params, batch = _vmc_data()
  in_rule = kfac_jax.Registration(_energy_rule(True), params, batch, estimation_mode="exact")
  apart = kfac_jax.Registration(
    _energy_rule(False), params, batch, estimation_mode="exact", curvature_fn=_log_psi_tagged
  )
  assert in_rule.fingerprint == apart.fingerprint

  @jax.jit  # One program for both registrations: run eagerly, each op compiles its own.
  def run(params, batch):
    results, grads = [], None
    for reg in (in_rule, apart):
      tx = kfac_jax.scale_by_kfac(registration=reg, damping=1e-3, ema_decay=0.0, inverse_every=1)
      state = tx.init(params)
      _, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch)
      updates, _ = tx.update(grads, state, params, curvature_stats=stats)
      opt = kfac_jax.Optimizer(registration=reg, learning_rate=0.1, momentum=0.0, damping=1e-3)
      new, _, info = opt.step(params, opt.init(params), batch, jax.random.key(0))
      results.append((updates, new, info["loss"]))
    return results, grads  # `apart`'s gradient.

  results, grads = run(params, batch)
  _close(results[0], results[1])
  # Not the identity: the Fisher of |psi|^2 preconditions.
  assert np.abs(np.asarray(results[0][0]["w1"] - grads["w1"])).max() > 1e-3


def test_no_tag_names_the_normal_tag_and_custom_rules():
  params, batch = _vmc_data()
  with pytest.raises(kfac_jax.RegistrationError) as e:
    kfac_jax.Registration(_energy_rule(False), params, batch)
  assert "register_normal_predictive_distribution" in str(e.value)
  assert "custom_jvp rule" in str(e.value) and "curvature_fn" in str(e.value)


def test_audit_points_a_vmc_loss_to_curvature_fn():
  """log|psi| tagged and the energy computed from its derivatives: the audit's error says
  what a VMC user should do."""
  params, batch = _vmc_data()

  def loss_fn(p, b):
    kfac_jax.register_normal_predictive_distribution(_log_psi(p, b["r"])[:, None])
    return jnp.mean(_local_energy(p, b["r"]))

  with pytest.raises(kfac_jax.RegistrationError, match="curvature_fn=log_psi_fn"):
    kfac_jax.Registration(loss_fn, params, batch)


def _log_psi_tagged_twice(p, b):
  log_psi = _log_psi(p, b["r"])[:, None]
  kfac_jax.register_normal_predictive_distribution(log_psi)
  kfac_jax.register_squared_error_loss(log_psi)


def _energy_rule_tagged_twice(p, b):
  @jax.custom_jvp
  def energy(p, r):
    return jnp.mean(_local_energy(p, r))

  @energy.defjvp
  def energy_jvp(primals, tangents):
    p, r = primals
    e_l = _local_energy(p, r)
    lp, dlp = jax.jvp(lambda q: _log_psi(q, r), (p,), (tangents[0],))
    kfac_jax.register_normal_predictive_distribution(lp[:, None])
    kfac_jax.register_normal_predictive_distribution(lp[:, None])
    return jnp.mean(e_l), 2.0 * jnp.mean((e_l - jnp.mean(e_l)) * dlp)

  return energy(p, b["r"])


def test_two_tags_on_one_log_psi_of_a_curvature_function_are_refused():
  """The loss is not the tags' (a `curvature_fn`, or tags in a custom_jvp rule), yet two tags
  on one prediction would count its curvature twice: refused naming both (the audit's
  "shared_prediction" check, which `check_loss` turns off)."""
  params, batch = _vmc_data()
  match = r"loss tag #1 \(register_normal_predictive_distribution.* and loss tag #2 .*same pred"
  with pytest.raises(kfac_jax.RegistrationError, match=match):
    kfac_jax.Registration(_energy_rule(False), params, batch, curvature_fn=_log_psi_tagged_twice)
  with pytest.raises(kfac_jax.RegistrationError, match=match):
    kfac_jax.Registration(_energy_rule_tagged_twice, params, batch)
  reg = kfac_jax.Registration(
    _energy_rule(False), params, batch, curvature_fn=_log_psi_tagged_twice, check_loss=False
  )
  assert len(reg.fingerprint.layers) == len(reg.layers)


def test_tags_in_loss_fn_beside_a_curvature_fn_are_named_as_not_read():
  """With `curvature_fn`, `loss_fn`'s own tags are not read: a LossMismatchWarning names them
  and the tags that define the curvature (an error with `strict`, nothing with
  `check_loss=False`); the curvature is `curvature_fn`'s."""
  params, batch = _vmc_data()

  def loss_fn(p, b):
    kfac_jax.register_squared_error_loss(_log_psi(p, b["r"])[:, None])
    return jnp.mean(_local_energy(p, b["r"]))

  with pytest.warns(kfac_jax.LossMismatchWarning) as record:
    reg = kfac_jax.Registration(loss_fn, params, batch, curvature_fn=_log_psi_tagged)
  (message,) = [str(w.message) for w in record if w.category is kfac_jax.LossMismatchWarning]
  assert "`loss_fn` has its own loss tag(s), loss tag #1 (register_squared_error_loss" in message
  assert "curvature is that of `curvature_fn`'s tags, loss tag #1 (register_normal_" in message
  want = kfac_jax.Registration(_energy_rule(False), params, batch, curvature_fn=_log_psi_tagged)
  assert reg.fingerprint == want.fingerprint
  with pytest.raises(kfac_jax.RegistrationError, match="strict=True"):
    kfac_jax.Registration(loss_fn, params, batch, curvature_fn=_log_psi_tagged, strict=True)
  kfac_jax.Registration(loss_fn, params, batch, curvature_fn=_log_psi_tagged, check_loss=False)


def test_curvature_fn_must_be_callable():
  params, batch = _vmc_data()
  with pytest.raises(TypeError, match="`curvature_fn` must be callable"):
    kfac_jax.Registration(_energy_rule(False), params, batch, curvature_fn="log_psi")


def test_optimizer_measures_rho_on_the_loss(x64):
  """With a curvature function, the damping adaptation's ρ compares `loss_fn` itself at the
  old and new params (the curvature graph's traced loss is zero)."""
  params, batch = _vmc_data()
  loss_fn = _energy_rule(False)
  reg = kfac_jax.Registration(
    loss_fn, params, batch, estimation_mode="exact", curvature_fn=_log_psi_tagged
  )
  opt = kfac_jax.Optimizer(registration=reg, damping=1e-2)
  # The same proposal, taken without adaptation (λ is only adapted after the step).
  fixed = kfac_jax.Optimizer(registration=reg, damping=1e-2, use_adaptive_damping=False)

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def run(params, batch):
    new, state, info = opt.step(params, opt.init(params), batch, jax.random.key(0))
    proposed, _, fixed_info = fixed.step(params, fixed.init(params), batch, jax.random.key(0))
    change = fixed_info["quad_model_change"]
    want = (loss_fn(proposed, batch) - loss_fn(params, batch)) / change
    return new, state, info, change, want

  new, state, info, change, want = run(params, batch)
  np.testing.assert_allclose(info["quad_model_change"], change, rtol=1e-8)
  np.testing.assert_allclose(info["rho"], want, rtol=1e-8)
  assert np.isfinite(state.rho)
  # On fixed walkers the energy rises along this step (ρ < 0): the step is not applied.
  assert float(info["rho"]) < 0
  for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_layer_inside_a_custom_function_with_no_reverse_derivative_is_named():
  """A dense layer inside a custom_vjp whose primal then runs a while_loop: its output
  gradients would need reverse mode through the loop; the error names the layer and the
  function, at registration."""

  @jax.custom_vjp
  def settle(w, x):
    h = x @ w
    return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1])), (0, h))[1]

  settle.defvjp(lambda w, x: (settle(w, x), (w, x)), lambda r, ct: (r[1].T @ ct, ct @ r[0].T))
  params, batch = _classifier_data()

  def loss_fn(p, b):
    logits = settle(p["w1"], b["x"]) @ p["w3"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  with pytest.raises(kfac_jax.RegistrationError, match="layer `w1` sits inside .*`settle`.*while"):
    kfac_jax.Registration(loss_fn, params, batch)


def test_factors_are_float64_under_x64(x64):
  """float32 parameters of a VMC model, x64 on: the factors and inverses are float64."""
  # One program for the casts: eagerly, each compiles its own.
  params, batch = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), t))(
    _vmc_data()
  )
  reg = kfac_jax.Registration(_energy_rule(True), params, batch)
  tx = kfac_jax.scale_by_kfac(registration=reg, damping=1e-3, inverse_every=1)

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def run(params, batch):
    _, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch, jax.random.key(0))
    return tx.update(grads, tx.init(params), params, curvature_stats=stats)[1]

  state = run(params, batch)
  floats = [x for x in jax.tree_util.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and all(x.dtype == jnp.float64 for x in floats)


# -- complex log psi: the Fisher of the complex mean, Re E[conj(J)ᵀ J] ---------------------


def _complex_log_psi(p, r):
  """psi = u + i v from a two-output network: log psi = log|psi| + i arg psi."""
  out = jnp.tanh(r @ p["w1"] + p["b1"]) @ p["w2"]
  return jnp.log(jax.lax.complex(out[:, 0], out[:, 1]))


def test_complex_log_psi_gives_the_exact_fisher(x64):
  params = {"w1": _normal(30, (D, H)), "b1": _normal(31, (H,), 0.1), "w2": _normal(32, (H, 2))}
  batch = {"r": _normal(33, (N, D))}

  def curvature_fn(p, b):
    kfac_jax.register_normal_predictive_distribution(_complex_log_psi(p, b["r"])[:, None])

  def energy(p, b):  # Only the gradient's source; the curvature is log psi's.
    return jnp.mean(jnp.abs(_complex_log_psi(p, b["r"])) ** 2)

  reg = kfac_jax.Registration(
    energy,
    params,
    batch,
    estimation_mode="exact",
    curvature_fn=curvature_fn,
    layers=kfac_jax.LayerConfig(defaults={"dense": "full"}),
  )
  assert [(s.kind, s.approx) for s in reg.layers] == [("dense", "full")] * 2
  est = kfac_jax.CurvatureEstimator(reg)

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def run(params, batch):
    state = est.update_curvature(est.init(params), params, batch, None, ema_decay=0.0)
    dense = est.to_dense(state)
    # Reference: (1/N) Σ_n Re(J_n^H J_n) / var, var = 0.5, J = ∂ log psi / ∂θ.
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    jacobians = [
      jax.jacobian(lambda v, part=part: part(_complex_log_psi(unravel(v), batch["r"])))(flat)
      for part in (jnp.real, jnp.imag)
    ]
    return dense, jacobians

  dense, (jr, ji) = run(params, batch)
  dense, jr, ji = np.asarray(dense), np.asarray(jr), np.asarray(ji)
  j = jr + 1j * ji
  fisher = np.real(j.conj().T @ j) / N / 0.5
  mask = np.zeros_like(fisher, bool)
  sizes = np.cumsum([0] + [x.size for x in jax.tree_util.tree_leaves(params)])
  leaf = {p: i for i, p in enumerate(reg.param_paths)}
  for s in reg.layers:
    idx = np.concatenate([np.arange(sizes[leaf[q]], sizes[leaf[q] + 1]) for q in s.param_paths])
    mask[np.ix_(idx, idx)] = True
  np.testing.assert_allclose(dense, fisher * mask, rtol=1e-10, atol=1e-12)
  # The phase counts: the Fisher of log|psi| alone (FermiNet's real-part tag) differs.
  assert np.abs((jr.T @ jr / N / 0.5 - fisher) * mask).max() > 1e-2


def test_complex_mean_tags_its_parts():

  @jax.jit  # One program for the inputs: eagerly, each op compiles its own.
  def inputs():
    z = jax.lax.complex(jnp.arange(4.0).reshape(4, 1), -jnp.ones((4, 1)))
    return z, z + 1j, jnp.full((4, 1), 2.0)

  z, t, w = inputs()
  jaxpr, out = jax.make_jaxpr(
    lambda z: kfac_jax.register_normal_predictive_distribution(z, t, weight=w), return_shape=True
  )(z)
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "kfac_loss_tag"]
  assert [v.aval.shape for v in eqn.invars] == [(4, 1, 2), (4, 1, 2), (4, 1, 1)]
  assert out.shape == (4, 1) and out.dtype == z.dtype
  np.testing.assert_array_equal(kfac_jax.register_normal_predictive_distribution(z), z)
  with pytest.raises(ValueError, match=r"`targets` has shape \(4,\), expected \(4, 1\)"):
    kfac_jax.register_normal_predictive_distribution(z, jnp.ones((4,), jnp.complex64))
  with pytest.raises(ValueError, match=r"`weight` of shape \(4,\) does not broadcast"):
    kfac_jax.register_normal_predictive_distribution(z, weight=jnp.ones(4))


# -- loss tags in a custom_vjp's fwd or bwd ------------------------------------------------


def _energy_vjp(where: str):
  """The VMC energy as a custom_vjp: fwd saves log psi, bwd gives the VMC gradient; the
  curvature's tag in fwd or in bwd (on the saved log psi)."""

  @jax.custom_vjp
  def energy(p, r):
    return jnp.mean(_local_energy(p, r))

  def fwd(p, r):
    e_l = _local_energy(p, r)
    lp = _log_psi(p, r)
    if where == "fwd":
      kfac_jax.register_normal_predictive_distribution(lp[:, None])
    return jnp.mean(e_l), (p, r, e_l, lp)

  def bwd(res, ct):
    p, r, e_l, lp = res
    if where == "bwd":
      kfac_jax.register_normal_predictive_distribution(lp[:, None])
    _, pull = jax.vjp(lambda q: _log_psi(q, r), p)
    (g,) = pull(2.0 * ct * (e_l - jnp.mean(e_l)) / e_l.shape[0])
    return g, jnp.zeros_like(r)

  energy.defvjp(fwd, bwd)
  return lambda p, b: energy(p, b["r"])


@pytest.mark.parametrize("where", ["fwd", "bwd"])
def test_tag_in_custom_vjp_equals_curvature_fn(x64, where):
  params, batch = _vmc_data()
  loss_fn = _energy_vjp(where)
  in_rule = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact")
  apart = kfac_jax.Registration(
    _energy_rule(False), params, batch, estimation_mode="exact", curvature_fn=_log_psi_tagged
  )
  assert in_rule.separate_loss and in_rule.fingerprint == apart.fingerprint

  @jax.jit
  def step():
    out = []
    for reg in (in_rule, apart):
      tx = kfac_jax.scale_by_kfac(registration=reg, damping=1e-3, ema_decay=0.0, inverse_every=1)
      loss, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch)
      out.append((loss, grads, tx.update(grads, tx.init(params), params, curvature_stats=stats)[0]))
    return out

  (loss, grads, updates), (want_loss, want_grads, want_updates) = step()
  _close(loss, want_loss)
  _close(grads, want_grads)  # The bwd's VMC gradient, as the custom_jvp rule's.
  _close(grads, jax.jit(jax.grad(loss_fn))(params, batch))
  _close(updates, want_updates)


# -- FermiNet's loss as FermiNet writes it: (E, aux), clipping, the tag in the JVP rule --------


def _sum_norm(tree):
  return float(sum(jnp.sum(jnp.abs(x) ** 2) for x in jax.tree_util.tree_leaves(tree)))


@pytest.mark.parametrize("complex_output", [False, True], ids=["real", "complex"])
def test_ferminet_loss_keeps_jax_value_aux_and_gradient(x64, complex_output):
  """The rule's aux differs from the function's (a scalar `clipped_energy` for a per-walker
  one; a complex energy made real): the registration finds the tag in the rule, and
  value_and_grad gives jax.value_and_grad's loss, aux and gradient."""
  loss_fn, params, batch, _ = _zoo.vmc_ferminet_loss(complex_output)
  reg = kfac_jax.Registration(loss_fn, params, batch, has_aux=True, estimation_mode="exact")
  assert reg.separate_loss

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def run(params, batch):
    got = kfac_jax.value_and_grad(registration=reg)(params, batch)
    return got, jax.value_and_grad(loss_fn, has_aux=True)(params, batch)

  ((loss, aux), grads, stats), ((want_loss, want_aux), want) = run(params, batch)
  _close((loss, aux, grads), (want_loss, want_aux, want), tol=1e-12)
  assert aux.clipped_energy.shape == () and aux.local_energy.shape == (_zoo.N,)
  assert _sum_norm(grads) > 1e-6
  assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(stats.data))


def test_ferminet_statistics_equal_curvature_fn(x64):
  """The tag in the rule gives the statistics of the same tag in `curvature_fn`; with both,
  `curvature_fn` wins: one on 2 log|psi| doubles every layer's output gradients, the rule's tag
  on log|psi| is not read."""
  loss_fn, params, batch, log_psi = _zoo.vmc_ferminet_loss()
  plain, *_ = _zoo.vmc_ferminet_loss(tag=False)

  def curvature(scale):
    def fn(p, b):
      kfac_jax.register_normal_predictive_distribution(scale * log_psi(p, b)[:, None])

    return fn

  kw = dict(has_aux=True, estimation_mode="exact")
  regs = [
    kfac_jax.Registration(loss_fn, params, batch, **kw),
    kfac_jax.Registration(plain, params, batch, curvature_fn=curvature(1.0), **kw),
    kfac_jax.Registration(loss_fn, params, batch, curvature_fn=curvature(2.0), **kw),
  ]
  assert len({r.fingerprint for r in regs}) == 1

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def run(params, batch):
    return [kfac_jax.value_and_grad(registration=r)(params, batch) for r in regs]

  outs = run(params, batch)
  for out in outs[1:]:
    _close(out[:2], outs[0][:2], tol=1e-12)  # The loss, aux and gradient are loss_fn's.
  in_rule, apart, both = (o[2].data for o in outs)
  _close(in_rule, apart, tol=1e-12)
  for (x, g), (x2, g2) in zip(in_rule, both):
    _close(x2, x, tol=1e-12)
    _close(g2, 2 * g, tol=1e-10)


# Every placement of the curvature's tag around a FermiNet-style rule on the small model: in
# the rule, in the custom function's primal, in loss_fn beside the call; with the rule's aux
# equal to the function's or FermiNet's (a scalar `clipped_energy`).


def _placed(places: frozenset, quirk: bool):
  def tag(p, b):
    kfac_jax.register_normal_predictive_distribution(_log_psi(p, b["r"])[:, None])

  @jax.custom_jvp
  def total_energy(p, b):
    e_l = _local_energy(p, b["r"])
    if "primal" in places:
      tag(p, b)
    loss = jnp.mean(e_l)
    return loss, _zoo.VmcAux(loss, jnp.var(e_l), e_l, e_l)

  @total_energy.defjvp
  def total_energy_jvp(primals, tangents):
    p, b = primals
    loss, aux = total_energy(p, b)
    centre, diff = _zoo._clipped(aux.local_energy, 5.0)
    if quirk:
      aux = aux._replace(clipped_energy=centre)
    lp, dlp = jax.jvp(lambda q: _log_psi(q, b["r"]), (p,), (tangents[0],))
    if "rule" in places:
      kfac_jax.register_normal_predictive_distribution(lp[:, None])
    return (loss, aux), (2.0 * jnp.dot(dlp, diff) / N, aux)

  def loss_fn(p, b):
    if "beside" in places:
      tag(p, b)
    return total_energy(p, b)

  return loss_fn


_BOTH = "both inside custom-derivative rules .*register_normal.* and outside them"
_OTHER = "returns primal outputs of other shapes .*clipped_energy=float64\\[\\].* tags outside"
PLACES = {  # places -> (FermiNet's aux, an aux equal to the function's): None or an error
  ("rule",): (None, None),
  ("beside",): (_OTHER, None),
  ("primal",): (_OTHER, None),
  ("primal", "beside"): (_OTHER, None),
  ("rule", "beside"): (_BOTH, _BOTH),
  ("rule", "primal"): (_BOTH, _BOTH),
  ("rule", "primal", "beside"): (_BOTH, _BOTH),
  (): ("no loss tag found", "no loss tag found"),
}


@pytest.mark.parametrize("quirk", [True, False], ids=["ferminet_aux", "same_aux"])
@pytest.mark.parametrize("places", sorted(PLACES), ids="+".join)
def test_tags_in_and_beside_a_rule_give_jax_grad_or_an_error(x64, places, quirk):
  """Never a silent zero or another gradient: each placement registers and gives
  jax.value_and_grad's loss, aux and gradient (custom rule kept), or is a RegistrationError
  that names the tags and the fix (`check_loss=False`: the audit would refuse a tag the energy
  does not depend on)."""
  params, batch = _vmc_data()
  loss_fn = _placed(frozenset(places), quirk)
  error = PLACES[places][0 if quirk else 1]
  if error is not None:
    with pytest.raises(kfac_jax.RegistrationError, match=error):
      kfac_jax.Registration(loss_fn, params, batch, has_aux=True, check_loss=False)
    return
  reg = kfac_jax.Registration(
    loss_fn, params, batch, has_aux=True, check_loss=False, estimation_mode="exact"
  )
  assert reg.separate_loss == ("rule" in places)

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def run(params, batch):
    got = kfac_jax.value_and_grad(registration=reg)(params, batch)[:2]
    return got, jax.value_and_grad(loss_fn, has_aux=True)(params, batch)

  got, want = run(params, batch)
  _close(got, want, tol=1e-12)
  assert _sum_norm(got[1]) > 1e-6  # The energy's aux repeats the loss: not a zero gradient.


def test_ferminet_rule_with_collectives_under_pmap(x64):
  """FermiNet's energy averaged over devices (`pmean` in the function and its rule), its aux
  FermiNet's: under pmap the rule's own call of the function, which only its tangent reads, is
  not evaluated (a collective is no effect to keep), and each device gets jax's loss, aux and
  gradient."""
  devices = 2

  def pmean(x):
    return jax.lax.pmean(x, "walkers")

  @jax.custom_jvp
  def total_energy(p, b):
    e_l = _local_energy(p, b["r"])
    loss = pmean(jnp.mean(e_l))
    return loss, _zoo.VmcAux(loss, pmean(jnp.mean((e_l - loss) ** 2)), e_l, e_l)

  @total_energy.defjvp
  def total_energy_jvp(primals, tangents):
    p, b = primals
    loss, aux = total_energy(p, b)
    centre, diff = _zoo._clipped(aux.local_energy, 5.0)
    lp, dlp = jax.jvp(lambda q: _log_psi(q, b["r"]), (p,), (tangents[0],))
    kfac_jax.register_normal_predictive_distribution(lp[:, None])
    aux = aux._replace(clipped_energy=centre)
    return (loss, aux), (pmean(2.0 * jnp.dot(dlp, diff) / N), aux)

  params, batch = _vmc_data()
  reg = kfac_jax.Registration(
    total_energy, params, batch, has_aux=True, collective_axes="walkers", estimation_mode="exact"
  )

  def both(p, b):
    got = kfac_jax.value_and_grad(registration=reg)(p, b)[:2]
    return got, jax.value_and_grad(total_energy, has_aux=True)(p, b)

  stack = lambda t: jax.tree_util.tree_map(lambda x: jnp.stack([x, 1.1 * x]), t)  # noqa: E731
  got, want = jax.pmap(both, axis_name="walkers")(stack(params), stack(batch))
  assert jax.tree_util.tree_leaves(got)[0].shape[0] == devices
  _close(got, want, tol=1e-12)

"""The loss audit at registration (kfac_jax/_audit.py): the tags against the returned loss.

Structure (two tags on one prediction, a tag the loss does not reach) is a RegistrationError;
a measured mismatch of the curvature (or, in the "empirical" mode, of the gradient) is one
LossMismatchWarning per registration, an error with `strict=True`, nothing with
`check_loss=False`. Correct losses that differ from the tags by a constant factor, an L2 penalty,
an auxiliary loss on another output, a mask given as the weight, or label smoothing (outside the
empirical mode) pass. The measured quantities are checked against jax.hessian / jax.grad in
float64.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from kfac_jax import _audit
from kfac_jax.scan import _scanner
from tests import _models

N, D, H, C = 6, 3, 8, 5
# Most losses leave a head out of the tags' inputs (a diagonal fallback block, warned about).
pytestmark = pytest.mark.filterwarnings("ignore::kfac_jax.UncoveredParametersWarning")


def _setup(dtype=jnp.float32):
  """Built on the host: each eager op (a `jax.random` draw too) would compile its own program."""
  params = {
    "w1": _models.normal(0, (D, H), dtype),
    "w2": _models.normal(1, (H, C), dtype, scale=0.5),
    "w3": _models.normal(3, (H, 2), dtype, scale=0.5),
  }
  batch = {
    "x": _models.normal(2, (N, D), dtype),
    "y": np.arange(N) % C,
    "mask": (np.arange(N) % 3 != 0).astype(dtype),
    "t": np.ones((N, 2), dtype),
  }
  return params, jax.device_put(batch)


def _net(p, b):
  h = jnp.tanh(b["x"] @ p["w1"])
  return h, h @ p["w2"], (h @ p["w3"] if "w3" in p else None)


def _ce(logits, b):
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])


def _sq(pred, b):
  return jnp.sum((pred - b["t"]) ** 2, -1)


# Losses whose tags describe them (up to a constant factor and terms that do not touch them).
def _mean(p, b):
  _, logits, _ = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  return _ce(logits, b).mean()


def _sum_l2(p, b):
  _, logits, _ = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  return _ce(logits, b).sum() + 1e-2 * sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(p))


def _aux_head(p, b):  # An untagged auxiliary loss on another output.
  _, logits, other = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  return _ce(logits, b).mean() + 0.3 * _sq(other, b).mean()


def _masked(p, b):
  _, logits, _ = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"], weight=b["mask"])
  return jnp.sum(b["mask"] * _ce(logits, b)) / jnp.sum(b["mask"])


def _two_heads(p, b):  # Two tags, weighted as the loss weighs them.
  _, logits, other = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  kfac_jax.register_squared_error_loss(other, b["t"], weight=0.25)
  return _ce(logits, b).mean() + 0.25 * _sq(other, b).mean()


def _elementwise_mean(p, b):  # A mean over every element: a factor 1/2 from the tag's sum.
  _, _, other = _net(p, b)
  kfac_jax.register_squared_error_loss(other, b["t"])
  return jnp.mean((other - b["t"]) ** 2)


def _smoothed(p, b):  # Smoothed labels, the hard ones tagged: the same curvature.
  _, logits, _ = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  return optax.softmax_cross_entropy(
    logits, optax.smooth_labels(jax.nn.one_hot(b["y"], C), 0.2)
  ).mean()


def _no_targets(p, b):
  _, logits, _ = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits)
  return _ce(logits, b).mean()


def _with_aux(p, b):
  _, logits, _ = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  return _ce(logits, b).mean(), {"logits": logits}


GOOD = [_mean, _sum_l2, _aux_head, _masked, _two_heads, _elementwise_mean, _smoothed, _no_targets]


@pytest.mark.parametrize("loss_fn", GOOD, ids=[f.__name__ for f in GOOD])
def test_correct_tags_pass(loss_fn):
  params, batch = _setup()
  scan = _scanner.scan(loss_fn, params, batch, warn=False)
  numbers = _audit.measure(scan, params, batch)
  assert all(n is not None and np.linalg.norm(n[1]) > 0 for n in numbers)  # It measured.
  assert _audit.problems(scan, numbers, "gradients") == []


def test_has_aux_and_empirical_mode_pass():
  params, batch = _setup()
  with warnings.catch_warnings():
    warnings.simplefilter("error", kfac_jax.LossMismatchWarning)
    kfac_jax.Registration(_with_aux, params, batch, has_aux=True)
    for loss_fn in (_mean, _sum_l2, _aux_head, _masked, _two_heads, _elementwise_mean):
      kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical")


# -- mismatches -------------------------------------------------------------------------------


def _squared_on_logits(p, b):
  _, logits, _ = _net(p, b)
  kfac_jax.register_squared_error_loss(logits, jax.nn.one_hot(b["y"], C))
  return _ce(logits, b).mean()


def _hidden(p, b):  # The tag on a hidden activation, the loss from the logits.
  h, logits, _ = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(h, b["y"])
  return _ce(logits, b).mean()


def _mask_missing(p, b):
  _, logits, _ = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  return jnp.sum(b["mask"] * _ce(logits, b)) / jnp.sum(b["mask"])


def _heads_misweighted(p, b):
  _, logits, other = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  kfac_jax.register_squared_error_loss(other, b["t"])
  return _ce(logits, b).mean() + 0.25 * _sq(other, b).mean()


def _negated(p, b):
  _, logits, _ = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  return -_ce(logits, b).mean()


BAD = [
  (_squared_on_logits, "loss tag #1 \\(register_squared_error_loss, prediction float32\\[6,5\\]"),
  (_hidden, "loss tag #1 \\(register_softmax_cross_entropy_loss, prediction float32\\[6,8\\]"),
  (_mask_missing, "differs from the tagged categorical loss's by a relative"),
  (_heads_misweighted, "weighted differently.*1 for loss tag #1.*0.25 for loss tag #2"),
  (_negated, "negative factor \\(-1\\)"),
]


@pytest.mark.parametrize("loss_fn, match", BAD, ids=[f.__name__ for f, _ in BAD])
def test_mismatch_warns_once_and_can_be_turned_off(loss_fn, match):
  params, batch = _setup()
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    kfac_jax.Registration(loss_fn, params, batch)
  (mismatch,) = [r for r in record if r.category is kfac_jax.LossMismatchWarning]
  text = str(mismatch.message)
  assert re.search(match, text), text
  assert "test_audit.py:" in text and "check_loss=False" in text
  with warnings.catch_warnings():
    warnings.simplefilter("error", kfac_jax.LossMismatchWarning)
    kfac_jax.Registration(loss_fn, params, batch, check_loss=False)


def test_strict_registration_raises_for_a_mismatch():
  params, batch = _setup()
  del params["w3"]  # Not in any layer: strict would stop at it first.
  with pytest.raises(kfac_jax.RegistrationError, match="register_squared_error_loss.*strict"):
    kfac_jax.Registration(_squared_on_logits, params, batch, strict=True)


def test_measured_mismatch_is_the_reference_residual(x64):
  """The number in the message is ‖a − c b‖/‖a‖ for a = H_L v, b = H_T v, c least squares,
  with H_L, H_T from jax.hessian of the returned and the tagged loss in the logits."""
  params, batch = _setup(jnp.float64)
  scan = _scanner.scan(_squared_on_logits, params, batch, warn=False)
  measured = _audit.measure(scan, params, batch)
  ((g_loss, h_loss, h_tag, g_tag),) = measured
  _, logits, _ = _net(params, batch)
  onehot = jax.nn.one_hot(batch["y"], C, dtype=jnp.float64)
  returned = lambda z: _ce(z, batch).mean()  # noqa: E731
  tagged = lambda z: jnp.mean(jnp.sum((z - onehot) ** 2, -1))  # noqa: E731
  v = np.random.default_rng(_audit._SEED).standard_normal(logits.shape)
  hl = np.asarray(_models.jit_hessian(returned)(logits)).reshape(N * C, N * C) @ v.ravel()
  ht = np.asarray(_models.jit_hessian(tagged)(logits)).reshape(N * C, N * C) @ v.ravel()
  np.testing.assert_allclose(h_loss, hl, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(h_tag, ht, rtol=1e-10, atol=1e-14)
  grad = lambda f: np.ravel(jax.jit(jax.grad(f))(logits))  # noqa: E731  # One program each.
  np.testing.assert_allclose(g_loss, grad(returned), rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(g_tag, grad(tagged), rtol=1e-10, atol=1e-14)
  c = hl @ ht / (ht @ ht)
  residual = np.linalg.norm(hl - c * ht) / np.linalg.norm(hl)
  (problem,) = _audit.problems(scan, measured, "gradients")
  assert f"relative {residual:.3g} after the best constant factor {c:.3g}" in problem


def test_empirical_mode_compares_the_targets():
  """Smoothed labels in the loss, hard labels in the tag: the same curvature (no warning in a
  Fisher mode), another empirical Fisher (a warning naming the gradient)."""
  params, batch = _setup()
  with pytest.warns(kfac_jax.LossMismatchWarning, match="gradient in this prediction differs"):
    kfac_jax.Registration(_smoothed, params, batch, estimation_mode="empirical")

  def wrong_labels(p, b):
    _, logits, _ = _net(p, b)
    kfac_jax.register_softmax_cross_entropy_loss(logits, (b["y"] + 1) % C)
    return _ce(logits, b).mean()

  with pytest.warns(kfac_jax.LossMismatchWarning, match=r"relative \d"):
    kfac_jax.Registration(wrong_labels, params, batch, estimation_mode="empirical")
  with warnings.catch_warnings():
    warnings.simplefilter("error", kfac_jax.LossMismatchWarning)
    kfac_jax.Registration(wrong_labels, params, batch, estimation_mode="gradients")


# -- structure --------------------------------------------------------------------------------


def _twice(p, b):
  _, logits, _ = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  return _ce(logits, b).mean()


def _twice_chained(p, b):  # The second tag on the first tag's output: the same value.
  _, logits, _ = _net(p, b)
  logits = kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  kfac_jax.register_squared_error_loss(logits)
  return _ce(logits, b).mean()


def _unreached(p, b):
  _, logits, other = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  kfac_jax.register_squared_error_loss(other, b["t"])  # `other` is not in the loss.
  return _ce(logits, b).mean()


def _stopped(p, b):
  _, logits, _ = _net(p, b)
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  return _ce(jax.lax.stop_gradient(logits), b).mean() + 0.0 * jnp.sum(p["w1"])


STRUCTURE = [
  (_twice, "loss tag #1 .* and loss tag #2 .* tag the same prediction"),
  (_twice_chained, "loss tag #1 .* and loss tag #2 \\(register_squared_error_loss.* the same"),
  (
    _unreached,
    "loss tag #2 \\(register_squared_error_loss, prediction float32\\[6,2\\].*does not ",
  ),
  (_stopped, "loss tag #1 .*does not depend on this prediction"),
]


def _complex(p, b):
  """A complex prediction `[N, 1]` of real parameters (a complex log psi)."""
  other = jnp.tanh(b["x"] @ p["w1"]) @ p["w3"]
  return jax.lax.complex(other[:, 0], other[:, 1])[:, None]


def _complex_squared(p, b):  # |z - t|², the squared error of the two parts.
  z = _complex(p, b)
  t = jax.lax.complex(b["t"][:, 0], b["t"][:, 1])[:, None]
  kfac_jax.register_squared_error_loss(z, t)
  return jnp.mean(jnp.abs(z - t) ** 2)


def _complex_normal(p, b):  # A normal tag on a complex log psi, its negative log-likelihood.
  log_psi = _complex(p, b)
  kfac_jax.register_normal_predictive_distribution(log_psi, jnp.zeros_like(log_psi), var=2.0)
  return jnp.mean(jnp.real(log_psi * jnp.conj(log_psi))) / 4


def _complex_quartic(p, b):  # Not the tag's loss: measured as a mismatch.
  z = _complex(p, b)
  kfac_jax.register_squared_error_loss(z)
  return jnp.mean(jnp.abs(z) ** 4)


def _complex_unreached(p, b):
  _, logits, _ = _net(p, b)
  kfac_jax.register_squared_error_loss(_complex(p, b))
  return _ce(logits, b).mean()


@pytest.mark.parametrize("loss_fn", [_complex_squared, _complex_normal])
def test_a_complex_prediction_is_audited_in_its_parts_and_trains(loss_fn):
  """A complex tag takes the parts `(Re z, Im z)` of a value the loss computes from `z`: the
  audit follows and perturbs `z` (no "does not depend"; the fit in real terms: the loss is
  the tag's sum over the two parts, c = 1), and `kfac` trains it."""
  params, batch = _setup()
  params = {k: params[k] for k in ("w1", "w3")}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    reg = kfac_jax.Registration(loss_fn, params, batch)
  assert reg.loss_factor == pytest.approx(1.0)
  tx = kfac_jax.kfac(registration=reg, learning_rate=0.3)

  @jax.jit
  def step(params, state, rng):
    loss, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  state = jax.jit(tx.init)(params)
  losses = []
  for i in range(8):
    params, state, loss = step(params, state, jax.random.key(i))
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0], losses


def test_a_complex_prediction_is_measured_in_real_terms(x64):
  """The measured `∂L/∂ε` and `∂²L/∂ε² v` are those of the loss as a function of the parts
  `[N, 1, 2]` (jax.grad / jax.hessian in float64); a loss that is not the tag's is a measured
  mismatch, a complex prediction the loss does not use the structural error."""
  params, batch = _setup(jnp.float64)
  scan = _scanner.scan(_complex_quartic, params, batch, warn=False)
  ((g_loss, h_loss, _, _),) = _audit.measure(scan, params, batch)
  parts = jnp.stack([jnp.real(_complex(params, batch)), jnp.imag(_complex(params, batch))], -1)

  def returned(x):
    return jnp.mean(jnp.abs(jax.lax.complex(x[..., 0], x[..., 1])) ** 4)

  v = np.random.default_rng(_audit._SEED).standard_normal(parts.shape)
  hl = np.asarray(_models.jit_hessian(returned)(parts)).reshape(2 * N, 2 * N) @ v.ravel()
  np.testing.assert_allclose(h_loss, hl, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(g_loss, np.ravel(jax.jit(jax.grad(returned))(parts)), rtol=1e-10)
  with pytest.warns(kfac_jax.LossMismatchWarning, match="register_squared_error_loss.*differs"):
    kfac_jax.Registration(_complex_quartic, params, batch)
  with pytest.raises(kfac_jax.RegistrationError, match="loss tag #1 .*does not depend"):
    kfac_jax.Registration(_complex_unreached, params, batch)


@pytest.mark.parametrize("loss_fn, match", STRUCTURE, ids=[f.__name__ for f, _ in STRUCTURE])
def test_structural_problems_are_errors_even_for_abstract_params(loss_fn, match):
  params, batch = _setup()
  with pytest.raises(kfac_jax.RegistrationError, match=match):
    kfac_jax.Registration(loss_fn, params, batch)
  shapes = jax.eval_shape(lambda t: t, (params, batch))
  with pytest.raises(kfac_jax.RegistrationError, match=match):
    kfac_jax.Registration(loss_fn, *shapes)
  with pytest.raises(kfac_jax.RegistrationError, match=match):
    jax.jit(kfac_jax.kfac(loss_fn, batch, learning_rate=0.1).init)(params)
  kfac_jax.Registration(loss_fn, params, batch, check_loss=False)


def test_abstract_and_traced_values_are_measured_on_stand_ins():
  """Abstract params and batch, or an init traced by `jax.jit`, are measured at fixed stand-ins:
  the mismatch is found as with concrete ones, and a fitting loss gets the same loss factor."""
  params, batch = _setup()
  shapes = jax.eval_shape(lambda t: t, (params, batch))
  for run in (
    lambda: kfac_jax.Registration(_squared_on_logits, *shapes),
    lambda: jax.jit(kfac_jax.kfac(_squared_on_logits, batch, learning_rate=0.1).init)(params),
    lambda: kfac_jax.kfac(_squared_on_logits, batch, learning_rate=0.1).init(params),
  ):
    with pytest.warns(kfac_jax.LossMismatchWarning, match="register_squared_error_loss"):
      run()
  eager = kfac_jax.Registration(_elementwise_mean, params, batch).loss_factor
  assert eager == 1 / 2  # A mean over the 2 outputs of the tag's sum of squares / 2 (snapped).
  assert kfac_jax.Registration(_elementwise_mean, *shapes).loss_factor == eager


def test_loss_factor_is_snapped_to_a_whole_ratio():
  assert _audit.snap(1 / 12 * (1 + 3e-4)) == 1 / 12
  assert _audit.snap(4.0 * (1 - 5e-4)) == 4.0
  assert _audit.snap(0.3172) == 0.317  # No whole ratio near: 3 significant digits.


def test_collective_axes_are_bound_for_the_measurement():
  """A loss with a collective over `axis_name` is measured with the axis bound at size 1."""
  params, batch = _setup()

  def loss_fn(p, b):
    _, logits, _ = _net(p, b)
    logits = logits - jax.lax.pmean(jnp.mean(logits, 0), "batch")
    kfac_jax.register_squared_error_loss(logits, jax.nn.one_hot(b["y"], C))
    return _ce(logits, b).mean()

  with pytest.warns(kfac_jax.LossMismatchWarning, match="register_squared_error_loss"):
    kfac_jax.Registration(loss_fn, params, batch, collective_axes="batch")


# -- a prediction and the loss's input written twice: one value ---------------------------------


def _reshaped_twice(p, b):  # A language model's [N, T, V] logits, flattened for each use.
  _, logits, _ = _net(p, b)
  z = logits.reshape(N // 2, 2, C)
  y = b["y"].reshape(N // 2, 2)
  kfac_jax.register_softmax_cross_entropy_loss(z.reshape(-1, C), y.reshape(-1))
  return optax.softmax_cross_entropy_with_integer_labels(z.reshape(-1, C), y.reshape(-1)).mean()


def _cast_twice(p, b):  # A bfloat16 model's logits, cast to float32 for each use.
  _, logits, _ = _net(p, b)
  z = logits.astype(jnp.bfloat16)
  kfac_jax.register_softmax_cross_entropy_loss(z.astype(jnp.float32), b["y"])
  return _ce(z.astype(jnp.float32), b).mean()


def _sliced_twice(p, b):  # Two heads sliced out of one output, for the tags and for the loss.
  _, logits, other = _net(p, b)
  z = jnp.concatenate([logits, other], axis=1)
  kfac_jax.register_softmax_cross_entropy_loss(z[:, :C], b["y"])
  kfac_jax.register_squared_error_loss(z[:, C:], b["t"], weight=0.5)
  return _ce(z[:, :C], b).mean() + 0.5 * _sq(z[:, C:], b).mean()


def _transposed_twice(p, b):  # Time-major logits, made batch-major for each use.
  _, logits, _ = _net(p, b)
  z = logits.reshape(2, N // 2, C)
  y = b["y"].reshape(N // 2, 2)
  kfac_jax.register_softmax_cross_entropy_loss(jnp.transpose(z, (1, 0, 2)), y)
  return optax.softmax_cross_entropy_with_integer_labels(jnp.transpose(z, (1, 0, 2)), y).mean()


def _broadcast_twice(p, b):  # One prediction scored against two sets of targets.
  _, _, other = _net(p, b)
  t = jnp.stack([b["t"], -b["t"]])
  kfac_jax.register_squared_error_loss(jnp.broadcast_to(other, (2, N, 2)), t)
  return jnp.sum((jnp.broadcast_to(other, (2, N, 2)) - t) ** 2, -1).mean()


def _asarray_and_stopped_targets(p, b):
  _, _, other = _net(p, b)
  t = jax.lax.stop_gradient(b["t"])
  kfac_jax.register_squared_error_loss(jnp.asarray(other), t)
  return _sq(jnp.asarray(other), b).mean()


SAME_VALUE = [
  _reshaped_twice,
  _cast_twice,
  _sliced_twice,
  _transposed_twice,
  _broadcast_twice,
  _asarray_and_stopped_targets,
]


@pytest.mark.parametrize("loss_fn", SAME_VALUE, ids=[f.__name__ for f in SAME_VALUE])
def test_a_prediction_written_twice_is_one_value(loss_fn):
  """The tag and the loss read two equations that compute the same value: registered, with no
  measured mismatch and a loss factor."""
  params, batch = _setup()
  with warnings.catch_warnings():
    warnings.simplefilter("error", kfac_jax.LossMismatchWarning)
    reg = kfac_jax.Registration(loss_fn, params, batch)
  assert reg.loss_factor is not None and reg.loss_factor > 0


def _other_slice(p, b):
  _, logits, other = _net(p, b)
  z = jnp.concatenate([logits, other], axis=1)
  kfac_jax.register_softmax_cross_entropy_loss(z[:, :C], b["y"])
  return _ce(z[:, 1 : C + 1], b).mean()


def _other_scale(p, b):
  _, logits, _ = _net(p, b)
  y = b["y"].reshape(N // 2, 2)
  kfac_jax.register_softmax_cross_entropy_loss(logits.reshape(N // 2, 2, C), y)
  return optax.softmax_cross_entropy_with_integer_labels(
    (2.0 * logits).reshape(N // 2, 2, C), y
  ).mean()


def _same_copy_tagged_twice(p, b):
  _, logits, _ = _net(p, b)
  y = b["y"].reshape(N // 2, 2)
  kfac_jax.register_softmax_cross_entropy_loss(logits.reshape(N // 2, 2, C), y)
  kfac_jax.register_softmax_cross_entropy_loss(logits.reshape(N // 2, 2, C), y)
  return _ce(logits, b).mean()


@pytest.mark.parametrize(
  "loss_fn, match",
  [
    (_other_slice, "loss tag #1 .*does not depend on this prediction"),
    (_other_scale, "loss tag #1 .*does not depend on this prediction"),
    (_same_copy_tagged_twice, "loss tag #1 .* and loss tag #2 .* tag the same prediction"),
  ],
  ids=["other_slice", "other_scale", "same_copy_tagged_twice"],
)
def test_another_value_is_still_a_mistake(loss_fn, match):
  params, batch = _setup()
  with pytest.raises(kfac_jax.RegistrationError, match=match):
    kfac_jax.Registration(loss_fn, params, batch)


def test_each_check_turns_off_alone_and_is_named():
  """Every message names the tag, its check and the `check_loss=` that turns that check off
  alone; turned off, the others still run."""
  params, batch = _setup()
  others = lambda name: tuple(c for c in _audit.CHECKS if c != name)  # noqa: E731
  for loss_fn, name in ((_stopped, "dependence"), (_twice, "shared_prediction")):
    with pytest.raises(kfac_jax.RegistrationError) as info:
      kfac_jax.Registration(loss_fn, params, batch)
    text = str(info.value)
    assert "loss tag #1" in text and f'check "{name}"' in text, text
    assert f"check_loss={others(name)!r}" in text, text
  # Without their structural checks, both are still measured: the doubled curvature, and none.
  with pytest.warns(kfac_jax.LossMismatchWarning, match="loss tag #2"):
    kfac_jax.Registration(_twice, params, batch, check_loss=others("shared_prediction"))
  with pytest.warns(kfac_jax.LossMismatchWarning, match="returned loss has no curvature"):
    kfac_jax.Registration(_stopped, params, batch, check_loss=others("dependence"))
  with pytest.warns(kfac_jax.LossMismatchWarning) as record:
    kfac_jax.Registration(_squared_on_logits, params, batch)
  (text,) = [str(r.message) for r in record if r.category is kfac_jax.LossMismatchWarning]
  assert 'check "curvature"' in text and f"check_loss={others('curvature')!r}" in text, text
  with warnings.catch_warnings():
    warnings.simplefilter("error", kfac_jax.LossMismatchWarning)
    kfac_jax.Registration(_squared_on_logits, params, batch, check_loss=others("curvature"))
    kfac_jax.Registration(
      _smoothed, params, batch, estimation_mode="empirical", check_loss=others("gradient")
    )
  with pytest.raises(kfac_jax.RegistrationError, match='check "dependence"'):
    kfac_jax.Registration(_stopped, params, batch, check_loss=others("curvature"))
  with pytest.warns(kfac_jax.LossMismatchWarning, match='check "gradient"'):
    kfac_jax.Registration(_smoothed, params, batch, estimation_mode="empirical")


def test_check_loss_is_validated():
  params, batch = _setup()
  with pytest.raises(TypeError, match="check_loss"):
    kfac_jax.Registration(_mean, params, batch, check_loss="no")
  with pytest.raises(ValueError, match="unknown loss audit checks \\['curvatur'\\]"):
    kfac_jax.Registration(_mean, params, batch, check_loss=("curvatur",))


# -- warnings once per registration -----------------------------------------------------------


def _uncovered_and_mismatched(p, b):
  h = jnp.tanh(b["x"] @ p["w1"]) * p["temp"] ** 2
  logits = h @ p["w2"]
  kfac_jax.register_squared_error_loss(logits, jax.nn.one_hot(b["y"], C))
  return _ce(logits, b).mean()


def _categories(record):
  return sorted(r.category.__name__ for r in record)


def test_each_warning_once_per_registration():
  """kfac(...), init and jitted steps (a second batch shape re-scans) warn once in all: one
  UncoveredParametersWarning and one LossMismatchWarning, at init; the steps, value_and_grad and
  every entry point sharing a Registration never warn again."""
  params, batch = _setup()
  params = dict(params, temp=jnp.ones(()))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    tx = kfac_jax.kfac(_uncovered_and_mismatched, batch, learning_rate=0.1)
    assert record == []
    state = tx.init(params)
    assert _categories(record) == ["LossMismatchWarning", "UncoveredParametersWarning"]

    @jax.jit
    def step(params, state, batch, rng):
      _, grads, stats = kfac_jax.value_and_grad(_uncovered_and_mismatched)(params, batch, rng)
      updates, state = tx.update(grads, state, params, curvature_stats=stats)
      return optax.apply_updates(params, updates), state

    half = jax.tree_util.tree_map(lambda x: x[: N // 2], batch)
    for i, b in enumerate([batch, batch, half, batch]):
      params, state = step(params, state, b, jax.random.key(i))
    assert len(record) == 2, _categories(record)

  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    reg = kfac_jax.Registration(_uncovered_and_mismatched, params, batch)
    assert _categories(record) == ["LossMismatchWarning", "UncoveredParametersWarning"]
    tx = kfac_jax.kfac(registration=reg, learning_rate=0.1)
    state = tx.init(params)
    opt = kfac_jax.Optimizer(registration=reg, learning_rate=0.1, momentum=0.0)
    # Jitted: tracing runs the same code as an eager call, without compiling op by op.
    opt_state = jax.jit(opt.init)(params)
    jax.jit(opt.step)(params, opt_state, batch, jax.random.key(0))
    vg = jax.jit(kfac_jax.value_and_grad(registration=reg))
    _, grads, stats = vg(params, batch, jax.random.key(1))
    jax.jit(lambda g, s, p, st: tx.update(g, s, p, curvature_stats=st))(grads, state, params, stats)
    assert len(record) == 2, _categories(record)


def test_message_names_the_line_of_the_tag():
  params, batch = _setup()
  with pytest.warns(kfac_jax.LossMismatchWarning) as record:
    kfac_jax.Registration(_squared_on_logits, params, batch)
  with open(__file__) as f:
    lines = f.read().splitlines()
  line = 1 + next(i for i, t in enumerate(lines) if "register_squared_error_loss(logits, jax" in t)
  (mismatch,) = [r for r in record if r.category is kfac_jax.LossMismatchWarning]
  assert re.search(rf"test_audit\.py:{line}\b", str(mismatch.message))


def test_a_loss_the_audit_cannot_differentiate_warns_and_registers():
  """A loss whose second derivative JAX cannot take (a callback after the logits) is not
  audited: one warning saying so, and the registration is built."""
  params, batch = _setup()

  def loss_fn(p, b):
    _, logits, _ = _net(p, b)
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    same = jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(logits.shape, logits.dtype), logits)
    return _ce(same, b).mean()

  with pytest.warns(kfac_jax.LossMismatchWarning, match="could not evaluate.*check_loss=False"):
    reg = kfac_jax.Registration(loss_fn, params, batch)
  assert [s.name for s in reg.layers][:2] == ["w1", "w2"]


def test_bfloat16_rounding_is_not_a_mismatch():
  """A bfloat16 model whose loss is computed in bfloat16 fits within the looser tolerance of
  its format (10 ulps); a squared-error tag on its logits still does not."""
  assert _audit.tolerance(jnp.bfloat16) == 10 * 2.0**-7
  params, batch = _setup(jnp.bfloat16)
  for loss_fn, expected in ((_mean, 0), (_squared_on_logits, 1)):
    scan = _scanner.scan(loss_fn, params, batch, warn=False)
    assert len(_audit.problems(scan, _audit.measure(scan, params, batch), "gradients")) == expected

"""`kfac_jax._verdict`: the step's verdicts on its inputs and hyperparameters, and the warnings
they give, eagerly and from a compiled step (opt-in)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax import _verdict


def _inputs(bad_leaf=None):
  grads = {"a": jnp.ones(3), "b": {"w": jnp.ones((2, 2))}}
  params = {"a": jnp.zeros(3), "b": {"w": jnp.zeros((2, 2))}}
  if bad_leaf == "gradient":
    grads["b"]["w"] = grads["b"]["w"].at[0, 1].set(jnp.inf)
  if bad_leaf == "params":
    params["a"] = params["a"].at[2].set(jnp.nan)
  return {"gradient": grads, "params": params}


def test_inputs_ok_is_the_conjunction_and_an_eager_call_names_the_leaf():
  reporter = _verdict.Reporter("kfac")
  assert bool(_verdict.inputs_ok(reporter, _inputs(), 0, True))
  with pytest.warns(
    kfac_jax.NonFiniteWarning, match=r"the gradient is not finite at step 4 \(in `b/w`\)"
  ):
    assert not bool(_verdict.inputs_ok(reporter, _inputs("gradient"), 4, True))
  with warnings.catch_warnings():  # Once per input.
    warnings.simplefilter("error")
    _verdict.inputs_ok(reporter, _inputs("gradient"), 5, True)


def test_bad_params_are_named_before_the_gradient_and_a_chained_front_says_why():
  inputs = _inputs("params")
  inputs["gradient"]["a"] = inputs["gradient"]["a"] * jnp.nan
  reporter = _verdict.Reporter("scale_by_kfac", chained=True)
  with pytest.warns(kfac_jax.NonFiniteWarning) as record:
    _verdict.inputs_ok(reporter, inputs, 1, False)
  (message,) = [str(r.message) for r in record]
  assert message.startswith("scale_by_kfac: the params are not finite at step 1 (in `a`)")
  assert "A transform chained after this one" in message and "is off" in message


@pytest.mark.parametrize("in_step", [False, True])
def test_a_compiled_step_warns_only_with_step_warnings(in_step):
  reporter = _verdict.Reporter("kfac", in_step=in_step)
  step = jax.jit(lambda inputs, clock: _verdict.inputs_ok(reporter, inputs, clock, True))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    assert not bool(step(_inputs("gradient"), 2))
    jax.effects_barrier()
  assert len(record) == int(in_step)
  jaxpr = jax.make_jaxpr(lambda inputs: _verdict.inputs_ok(reporter, inputs, 0, True))(_inputs())
  assert ("callback" in str(jaxpr)) == in_step  # No host callback: a cacheable program.


def test_hyperparameters_ok_looks_at_schedule_values_only():
  reporter = _verdict.Reporter("kfac")
  assert (
    _verdict.hyperparameters_ok(reporter, {"lr": (0.1, 0.0), "mu": (None, None)}, 0, True) is None
  )
  good = {"lr": (jnp.float32(0.1), 0.0), "mu": (jnp.float32(-3.0), None)}
  assert bool(_verdict.hyperparameters_ok(reporter, good, 0, True))
  with pytest.warns(
    kfac_jax.HyperparameterWarning,
    match=r"`lr` gave -1.0 at step 7 \(it must be finite and >= 0.0\); the step is skipped",
  ):
    ok = _verdict.hyperparameters_ok(reporter, {"lr": (jnp.float32(-1.0), 0.0)}, 7, True)
  assert not bool(ok)


def test_failed_inverses_are_named_once_per_block():
  reporter = _verdict.Reporter("kfac")
  blocks = ("`dense_0` (KroneckerBlock)", "`dense_1` (KroneckerBlock)")
  with pytest.warns(kfac_jax.FailedInverseWarning) as record:
    reporter.inverses(blocks, 3, np.array([[False, True], [False, True]]), 0.1)
    reporter.inverses(blocks, 4, np.array([False, True]), 0.1)
  (message,) = [str(r.message) for r in record]
  assert "`dense_1` (KroneckerBlock) was not finite at step 3 (damping 0.1)" in message


def test_tree_vdot_accumulates_bfloat16_in_float32():
  x = {"a": jnp.full((4096,), 1.0 / 3, jnp.bfloat16)}
  got = _verdict.tree_vdot(x, x)
  assert got.dtype == jnp.float32
  want = 4096 * float(jnp.asarray(1.0 / 3, jnp.bfloat16)) ** 2
  np.testing.assert_allclose(float(got), want, rtol=1e-6)

"""`kfac_jax.blocks._base`: the numerics record, stacked uses, the flat vector helpers and the
grouped factorisations (the block kinds themselves: test_kronecker.py, test_uses.py, ...)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax.blocks import _base
from tests import _models


def test_block_config_of_resolves_the_user_spellings():
  config = _base.BlockConfig.of(stats_dtype="bfloat16", preconditioner_dtype="bfloat16")
  assert config.stats_dtype == jnp.bfloat16 and config.inverse_dtype == np.float32
  assert config.preconditioner_dtype == jnp.bfloat16 and config.accum_dtype == np.float32
  same = _base.BlockConfig.of(preconditioner_dtype="float32")  # Equal to inverse_dtype: None.
  assert same.preconditioner_dtype is None
  assert _base.BlockConfig.of(exps=(-1, 0.5)).cached_exps == (-1.0, 0.5)
  assert _base.BlockConfig.of(exps=(1, -1, 0.5)).power_index(0.5) == 1


@pytest.mark.parametrize(
  "kw, exc, match",
  [
    ({"damping_mode": "tikhonov"}, ValueError, "config.damping_mode 'tikhonov'"),
    ({"damping_mode": 3}, TypeError, "config.damping_mode 3"),
    ({"factor_solve": "sometimes"}, ValueError, "config.factor_solve"),
    ({"stats_dtype": "int8"}, ValueError, "config.stats_dtype"),
    ({"inverse_dtype": "bfloat16"}, ValueError, "config.inverse_dtype"),
    ({"inverse_dtype": "float64"}, ValueError, "needs 64-bit JAX"),
  ],
)
def test_block_config_of_names_a_bad_field(kw, exc, match):
  with pytest.raises(exc, match=match):
    _base.BlockConfig.of(**kw)


def test_a_preconditioner_dtype_wider_than_the_inverses_is_refused(x64):
  with pytest.raises(ValueError, match="wider than `inverse_dtype`=float32"):
    _base.BlockConfig.of(inverse_dtype="float32", preconditioner_dtype="float64")


@pytest.mark.parametrize(
  "mode, factored, split",
  [("factored", True, "pi"), ("factored_equal", True, "equal"), ("eigen", False, "pi")],
)
def test_damping_modes(mode, factored, split):
  config = _base.BlockConfig.of(damping_mode=mode)
  assert config.factored is factored and config.split == split


def test_stored_power_narrows_matrices_only():
  config = _base.BlockConfig.of(preconditioner_dtype="bfloat16")
  assert config.stored_power(jnp.ones((3, 3))).dtype == jnp.bfloat16
  assert config.stored_power(jnp.ones(3)).dtype == jnp.float32  # A diagonal factor's powers.
  assert _base.BlockConfig.of().stored_power(jnp.ones((3, 3))).dtype == jnp.float32


def test_stacked_uses_unstack_into_steps():
  x = jnp.arange(12.0).reshape(3, 4)  # T = 3 steps of a [4] input.
  g = jnp.arange(18.0).reshape(2, 3, 3)  # 2 samples, 3 steps, [3] outputs.
  uses = _base.StackedUses((x,), g).unstack()
  assert len(uses) == 3
  for t, (inputs, gt) in enumerate(uses):
    np.testing.assert_array_equal(inputs[0], x[t])
    np.testing.assert_array_equal(gt, g[:, t])


def test_flat_and_unflat_round_trip_in_the_leaves_dtypes():
  like = [jnp.ones((2, 3), jnp.bfloat16), jnp.arange(4.0)]
  v = _base.flat(like, jnp.float32)
  assert v.shape == (10,) and v.dtype == jnp.float32
  back = _base.unflat(v, like)
  assert [b.dtype for b in back] == [jnp.bfloat16, jnp.float32]
  for a, b in zip(like, back):
    np.testing.assert_array_equal(a, b)


def test_map_factorisations_equals_one_call_per_slice():
  mats = jnp.asarray(_models.np_rng(0).standard_normal((3, 4, 4)))
  spd = mats @ jnp.swapaxes(mats, 1, 2) + 4 * jnp.eye(4)
  out = jax.jit(lambda m: _base.map_factorisations(jnp.linalg.cholesky, m))(spd)
  for k in range(3):
    np.testing.assert_allclose(out[k], np.linalg.cholesky(np.asarray(spd[k])), rtol=1e-5)

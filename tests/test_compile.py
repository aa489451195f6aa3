"""`kfac_jax.compile_step`: a step compiled ahead of time, its wait told where it happens."""

import jax
import jax.numpy as jnp
import numpy as np

import kfac_jax


def test_compile_step_is_the_jitted_step_and_says_where_it_came_from():
  """The test processes keep JAX's persistent cache on (conftest): a new program is written to
  it, the same one again is this process's, and each compile is told in two lines."""

  def step(x, y):
    return jnp.tanh(x) @ y * 1.2345

  x, y = jnp.ones((3, 4)), jnp.arange(8.0).reshape(4, 2)
  lines = []
  first = kfac_jax.compile_step(step, x, y, name="the probe", log=lines.append)
  np.testing.assert_allclose(first(x, y), jax.jit(step)(x, y), rtol=1e-6)
  kfac_jax.compile_step(step, x, y, name="the probe", log=lines.append)
  assert lines[0] == "compiling the probe..." and lines[2] == "compiling the probe..."
  assert lines[1].startswith("compiled the probe in ") and "written to" in lines[1], lines
  assert "compiled before in this process" in lines[3], lines


def test_compile_step_is_silent_with_log_none(capsys):
  compiled = kfac_jax.compile_step(lambda x: x + 1, jnp.zeros(2), log=None)
  assert capsys.readouterr().out == ""
  np.testing.assert_array_equal(compiled(jnp.zeros(2)), np.ones(2))

"""`benchmarks/compile_time.py` and `benchmarks/profile/compile_parts.py`: the training steps
they build for each front, the table's ratios to Adam and the kernel count by source region."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import compile_time
from benchmarks.profile import compile_parts
from kfac_jax import _storage


@pytest.fixture
def x64_restored():
  """The PINN build turns on float64 for its process; the worker's other tests run without."""
  previous = jax.config.jax_enable_x64  # type: ignore[attr-defined]
  yield
  jax.config.update("jax_enable_x64", previous)


@pytest.mark.parametrize("workload", ["zoo:mlp", "pinn"])
@pytest.mark.parametrize("front", compile_time.FRONTS)
def test_every_front_builds_a_training_step(front, workload, x64_restored):
  step, (params, state, batch, rng) = compile_time.build(workload, front, pinn_sizes=(2, 8, 1))
  new_params, new_state, loss = jax.eval_shape(step, params, state, batch, rng)
  assert jax.tree.structure(new_params) == jax.tree.structure(params)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  assert loss.shape == ()


def test_an_unknown_workload_or_front_is_refused():
  with pytest.raises(ValueError, match="unknown workload 'mnist'"):
    compile_time.build("mnist", "adam")
  with pytest.raises(ValueError, match="unknown front 'sgd'"):
    compile_time.build("zoo:mlp", "sgd")


def _launch(trace_lower, compile_s, hits=0):
  return {
    "trace": trace_lower / 2,
    "lower": trace_lower / 2,
    "compile": compile_s,
    "trace_lower_cpu": 2 * trace_lower,
    "compile_cpu": 2 * compile_s,
    "hits": hits,
    "written": 1 - hits,
    "lines": 1234,
    "callbacks": 0,
  }


def test_the_table_gives_each_front_its_ratios_to_adam_in_the_same_kind_of_launch():
  results = {
    "w": {
      "adam": (_launch(1.0, 2.0), _launch(1.0, 0.5, hits=1)),
      "kfac": (_launch(3.0, 10.0), _launch(3.0, 10.0)),
    }
  }
  rows = compile_time.table(results).splitlines()
  assert rows[2] == "| w | adam | 1.00 | 2.00 | 0.50 | yes | 1.0x | 1.0x | 1.0x | 1,234 |"
  assert rows[3] == "| w | kfac | 3.00 | 10.00 | 10.00 | no | 3.0x | 5.0x | 20.0x | 1,234 |"
  cpu = compile_time.table(results, "cpu").splitlines()
  assert cpu[3] == "| w | kfac | 6.00 | 20.00 | 20.00 | no | 3.0x | 5.0x | 20.0x | 1,234 |"


def test_kernels_are_counted_by_the_library_function_that_emitted_them():
  tree = {"a": jnp.ones((3, 4)), "b": jnp.ones((5,))}

  def f(t):
    return _storage.all_finite(t), jnp.sin(t["a"]) @ t["a"].T

  counts = compile_parts.kernels(jax.jit(f).lower(tree).compile().as_text())
  assert counts["_storage.all_finite"] >= 1, counts
  assert counts["model / step"] >= 1, counts  # The product, written outside the library.
  assert set(counts) <= {"_storage.all_finite", "model / step"} | {
    k for k in counts if k.startswith("(no source")
  }, counts

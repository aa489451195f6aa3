"""Every `>>>` example in the public docstrings runs.

The examples use the names a reader has in scope at that point of a training script
(`loss_fn`, `params`, `batch`, `rng`, `model`, `tx`, `opt_state`, `grads`); this test defines
them for a small Flax MLP (or, for the BatchNorm example, an MLP with BatchNorm) and runs each
docstring's examples in order in one namespace. The examples show no printed output, so only
that they run is checked (any exception fails the test).
"""

import doctest
import functools
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import kfac_jax
import kfac_jax.flax
from tests import _models


class _Checker(doctest.OutputChecker):
  def check_output(self, want, got, optionflags):  # noqa: ARG002 - printed tables vary.
    return True


class _Mlp(nn.Module):
  batch_norm: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    if self.batch_norm:
      x = nn.BatchNorm(use_running_average=False)(x)
    return nn.Dense(3)(jnp.tanh(x))


@functools.cache
def _built(batch_norm: bool) -> dict:
  """The names, built once per model for every docstring (the builds compile; `_namespace`
  hands each docstring its own copy)."""
  model = _Mlp(batch_norm)
  x = _models.normal(0, (16, 5))  # Drawn on the host, the builds below jitted: eagerly,
  y = _models.integers(1, 0, 3, (16,))  # each operation would compile a program of its own.
  variables = jax.jit(model.init)(jax.random.key(2), x)
  if batch_norm:
    params, batch = variables["params"], {"x": x, "y": y, "batch_stats": variables["batch_stats"]}

    def loss_fn(params, batch):
      logits, _ = model.apply(
        {"params": params, "batch_stats": batch["batch_stats"]}, batch["x"], mutable=["batch_stats"]
      )
      kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  else:
    params, batch = variables, {"x": x, "y": y}

    def loss_fn(params, batch):
      logits = model.apply(params, batch["x"])
      kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.1)
  return {
    "jax": jax,
    "jnp": jnp,
    "optax": optax,
    "kfac_jax": kfac_jax,
    "nn": nn,
    "model": model,
    "params": params,
    "batch": batch,
    "loss_fn": loss_fn,
    "rng": jax.random.key(3),
    "tx": tx,
    "opt_state": jax.jit(tx.init)(params),
    "grads": jax.jit(jax.grad(loss_fn))(params, batch),
  }


def _namespace(batch_norm: bool) -> dict:
  """A fresh namespace: new containers (dicts, states) around the shared arrays, so that an
  example that rebinds or mutates a name leaves the next docstring's names as built."""
  return {k: jax.tree.map(lambda x: x, v) for k, v in _built(batch_norm).items()}


def _public_docstrings():
  """(name, object) for kfac_jax's public names and their public methods, and the flax module."""
  seen, out = set(), []

  def add(name, obj):
    if id(obj) not in seen and isinstance(inspect.getdoc(obj), str) and ">>>" in obj.__doc__:
      seen.add(id(obj))
      out.append((name, obj))

  for name in kfac_jax.__all__:
    obj = getattr(kfac_jax, name)
    add(name, obj)
    if inspect.isclass(obj):
      for attr, member in vars(obj).items():
        if not attr.startswith("_"):
          add(f"{name}.{attr}", member)
    if inspect.ismodule(obj):  # `kfac_jax.pinn`: its public names.
      for attr in obj.__all__:
        add(f"{name}.{attr}", getattr(obj, attr))
  add("kfac_jax.flax", kfac_jax.flax)
  return out


EXAMPLES = _public_docstrings()
BATCH_NORM = {"value_and_grad"}  # Docstrings whose examples use a BatchNorm model.


def test_the_public_api_has_examples():
  names = {n for n, _ in EXAMPLES}
  assert {
    "kfac",
    "scale_by_kfac",
    "value_and_grad",
    "Optimizer",
    "CurvatureEstimator",
    "summary",
    "kfac_jax.flax",
    "pinn.laplacian",
    "pinn.differential_operator",
    "pinn.grid_linesearch",
    "pinn.optimizer",
  } <= names, sorted(names)


@pytest.mark.parametrize("name,obj", EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_docstring_examples_run(name, obj):
  (test,) = doctest.DocTestFinder(recurse=False).find(obj, name)
  test.globs = _namespace(batch_norm=name in BATCH_NORM)
  runner = doctest.DocTestRunner(checker=_Checker(), optionflags=doctest.ELLIPSIS)
  failures = []

  def report_unexpected_exception(out, test, example, exc_info):
    failures.append(f"{example.source.strip()}\n  -> {exc_info[0].__name__}: {exc_info[1]}")

  runner.report_unexpected_exception = report_unexpected_exception
  result = runner.run(test, out=lambda s: None)
  assert result.attempted > 0
  assert not failures, f"{name}:\n" + "\n".join(failures)

"""Checkpoints continue a run bit-for-bit; restoring into a changed model names the blocks."""

import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup(hidden=5):
  params = _models.jnp_mlp_init(jax.random.key(0), (4, hidden, 3))
  batches = [
    _models.classification_batch(jax.random.key(10 + i), n=16, din=4, classes=3) for i in range(6)
  ]
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  tx = kfac_jax.kfac(
    loss_fn, batches[0], learning_rate=0.2, momentum=0.9, damping=1e-2, inverse_every=2
  )

  @jax.jit
  def step(params, state, batch, rng):
    _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  return params, batches, tx, step


def _run(params, state, batches, step, start, stop):
  for i in range(start, stop):
    params, state = step(params, state, batches[i], jax.random.key(100 + i))
  return params, state


def _assert_bit_identical(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_flax_bytes_round_trip_continues_bit_identically():
  params, batches, tx, step = _setup()
  want = _run(params, tx.init(params), batches, step, 0, 6)
  p3, s3 = _run(params, tx.init(params), batches, step, 0, 3)
  data = kfac_jax.state_to_bytes(s3)
  restored = kfac_jax.state_from_bytes(tx.init(params), data)
  _assert_bit_identical(restored, s3)
  _assert_bit_identical(_run(p3, restored, batches, step, 3, 6), want)


_FRESH = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import jax, numpy as np
    import kfac_jax
    from flax import serialization
    from tests.test_checkpoint import _setup, _run
    params, batches, tx, step = _setup()
    with open({path!r} + ".state", "rb") as f:
      state = kfac_jax.state_from_bytes(tx.init(params), f.read())
    with open({path!r} + ".params", "rb") as f:
      params = serialization.from_bytes(params, f.read())
    params, state = _run(params, state, batches, step, 3, 6)
    with open({path!r} + ".out", "wb") as f:
      f.write(kfac_jax.state_to_bytes((params, state)))
""")


def test_restore_in_a_fresh_process_continues_bit_identically(tmp_path):
  from flax import serialization

  params, batches, tx, step = _setup()
  want = _run(params, tx.init(params), batches, step, 0, 6)
  p3, s3 = _run(params, tx.init(params), batches, step, 0, 3)
  path = str(tmp_path / "ckpt")
  with open(path + ".state", "wb") as f:
    f.write(kfac_jax.state_to_bytes(s3))
  with open(path + ".params", "wb") as f:
    f.write(serialization.to_bytes(p3))
  # A fresh process with its own (default) device setup and the suite's other XLA flags.
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
  subprocess.run(
    [sys.executable, "-c", _FRESH.format(root=ROOT, path=path)],
    check=True,
    env=env,
    cwd=ROOT,
    timeout=300,
  )
  with open(path + ".out", "rb") as f:
    got = serialization.from_bytes(want, f.read())
  _assert_bit_identical(got, want)


def test_orbax_round_trip_continues_bit_identically(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  params, batches, tx, step = _setup()
  want = _run(params, tx.init(params), batches, step, 0, 6)
  p3, s3 = _run(params, tx.init(params), batches, step, 0, 3)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "state", (p3, s3))
  ckpt.wait_until_finished()
  template = jax.eval_shape(lambda: (params, tx.init(params)))
  p_r, s_r = ckpt.restore(tmp_path / "state", template)
  kfac_jax.check_restored_state(template, (p_r, s_r))
  _assert_bit_identical(_run(p_r, s_r, batches, step, 3, 6), want)


def test_nnx_optimizer_round_trip_continues_bit_identically():
  """`state_to_bytes` takes what `nnx.Optimizer` holds (the optimizer, `nnx.state` of it, or its
  `opt_state`); `state_from_bytes` restores into `nnx.state(optimizer)`, applied with
  `nnx.update`, and refuses the optimizer itself, naming what to pass."""
  nnx = pytest.importorskip("flax.nnx")
  batches = [
    _models.classification_batch(jax.random.key(10 + i), n=16, din=4, classes=3) for i in range(4)
  ]
  graphdef, _ = nnx.split(_models.NnxMLP(4, 5, 3, nnx.Rngs(0)))

  def loss_fn(params, batch):
    logits = nnx.merge(graphdef, params)(batch["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  tx = kfac_jax.kfac(loss_fn, batches[0], learning_rate=0.2, inverse_every=2)

  def fresh():
    model = _models.NnxMLP(4, 5, 3, nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch, rng):
    params = nnx.state(model, nnx.Param)
    _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    optimizer.update(model, grads, curvature_stats=stats)

  def run(model, optimizer, start, stop):
    for i in range(start, stop):
      step(model, optimizer, batches[i], jax.random.key(100 + i))

  want_model, want = fresh()
  run(want_model, want, 0, 4)
  model, optimizer = fresh()
  run(model, optimizer, 0, 2)
  data = kfac_jax.state_to_bytes(optimizer)
  assert data == kfac_jax.state_to_bytes(nnx.state(optimizer))
  assert kfac_jax.state_to_bytes(optimizer.opt_state)
  with pytest.raises(TypeError, match=r"pass its state.*nnx.state\(optimizer\).*nnx.update"):
    kfac_jax.state_from_bytes(optimizer, data)
  params = nnx.state(model, nnx.Param)
  restored_model, restored = fresh()
  nnx.update(restored_model, params)
  nnx.update(restored, kfac_jax.state_from_bytes(nnx.state(restored), data))
  _assert_bit_identical(nnx.state(restored), nnx.state(optimizer))
  run(restored_model, restored, 2, 4)
  _assert_bit_identical(nnx.state(restored), nnx.state(want))
  _assert_bit_identical(nnx.state(restored_model), nnx.state(want_model))


def test_restoring_into_a_changed_model_names_the_blocks():
  params, batches, tx, step = _setup(hidden=5)
  _, saved = _run(params, tx.init(params), batches, step, 0, 1)
  wider, _, tx_w, _ = _setup(hidden=7)
  template = tx_w.init(wider)
  with pytest.raises(ValueError, match=r"block `layer0`.*\(6, 6\)|block `layer0`"):
    kfac_jax.state_from_bytes(template, kfac_jax.state_to_bytes(saved))
  with pytest.raises(ValueError, match="layer1"):
    kfac_jax.check_restored_state(template, saved)
  deeper = _models.jnp_mlp_init(jax.random.key(0), (4, 5, 5, 3))
  tx_d = kfac_jax.kfac(_models.softmax_loss(_models.jnp_mlp_apply), batches[0], learning_rate=0.1)
  with pytest.raises(ValueError, match=r"blocks missing from the checkpoint: \['layer2'\]"):
    kfac_jax.check_restored_state(jax.eval_shape(tx_d.init, deeper), saved)  # Shapes suffice.


def test_changed_estimator_options_name_the_block_fields():
  """The typed block state's field paths name what differs (here: cached powers, Cholesky)."""
  params, batches, _, _ = _setup()
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)

  def state(**kw):
    reg = kfac_jax.Registration(loss_fn, params, batches[0])
    return kfac_jax.CurvatureEstimator(reg, **kw).init(params)

  saved, want = state(), state(exps=(-1, -0.5), compute_cholesky=True)
  cache = want.cache["layer0"]
  assert isinstance(cache, kfac_jax.blocks.KroneckerCache) and len(cache.a.powers) == 2
  assert cache.a.evecs is None and saved.cache["layer0"].a.chol is None
  with pytest.raises(ValueError) as e:
    kfac_jax.check_restored_state(want, saved)
  msg = str(e.value)
  assert "block `layer0`: `cache/a/powers/1` is missing from the checkpoint" in msg, msg
  assert "block `layer1`: `cache/g/chol` is missing from the checkpoint" in msg, msg
  assert "blocks missing" not in msg, msg
  kfac_jax.check_restored_state(saved, state())  # The same options: no error.


def test_same_seed_same_data_is_bit_identical_after_100_steps():
  params, batches, tx, step = _setup()
  batches = batches * 17

  def run():
    return _run(params, tx.init(params), batches, step, 0, 100)

  _assert_bit_identical(run(), run())

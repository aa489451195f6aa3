"""`kfac_jax._fit`: the bounded memo, params signatures and the state-fit check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax import _fit


def test_memo_makes_once_and_drops_the_oldest_past_its_size():
  memo, made = _fit.Memo(2), []

  def make(k):
    made.append(k)
    return k * 10

  assert memo("a", lambda: make(1)) == 10
  assert memo("a", lambda: make(99)) == 10  # Kept: not made again.
  memo("b", lambda: make(2))
  memo("c", lambda: make(3))  # Drops "a", the oldest.
  assert made == [1, 2, 3]
  assert memo.get("a") is None and memo.get("b") == 20 and memo.get("c") == 30
  memo.put("b", 21)  # Replacing a kept key drops nothing.
  assert memo.get("b") == 21 and memo.get("c") == 30


def test_signature_tells_shapes_dtypes_and_structure_apart():
  a = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
  assert _fit.signature(a) == _fit.signature({"w": jnp.ones((2, 3)), "b": jnp.ones(3)})
  assert _fit.signature(a) != _fit.signature({"w": jnp.zeros((3, 2)), "b": jnp.zeros(3)})
  assert _fit.signature(a) != _fit.signature({"w": jnp.zeros((2, 3), jnp.int32), "b": a["b"]})
  assert _fit.signature(a) != _fit.signature([a["w"], a["b"]])


def test_state_shapes_trace_init_once_per_signature():
  calls = []

  def init(params):
    calls.append(1)
    return {"m": jnp.zeros_like(params["w"])}

  shapes = _fit.state_shapes(init)
  p = {"w": jnp.zeros((2, 3))}
  for _ in range(3):
    out = shapes(p)
  assert len(calls) == 1
  assert out["m"].shape == (2, 3) and isinstance(out["m"], jax.ShapeDtypeStruct)
  shapes({"w": jnp.zeros((4,))})
  assert len(calls) == 2


def _state(layers, trace=False):
  factors = {n: {"a": np.zeros((s, s), np.float32)} for n, s in layers.items()}
  state = {
    "curvature": {"factors": factors, "cache": {n: {"inv": f["a"]} for n, f in factors.items()}}
  }
  if trace:
    state["rest"] = {"trace": np.zeros(3, np.float32)}
  return state


def test_check_names_missing_and_extra_blocks_and_shape_changes():
  want = _state({"dense_0": 3, "dense_1": 4})
  _fit.check(want, _state({"dense_0": 3, "dense_1": 4}), "kfac")  # Fits: no error.
  with pytest.raises(ValueError) as e:
    _fit.check(want, _state({"dense_0": 5, "dense_2": 4}), "kfac")
  msg = str(e.value)
  assert msg.startswith("kfac: `state` is not a state of this model and front")
  assert "blocks missing from `state`: ['dense_1']" in msg
  assert "blocks in `state` that this model does not have: ['dense_2']" in msg
  assert "block `dense_0` `factors/a`" in msg and "(5, 5) float32" in msg and "(3, 3)" in msg


def test_check_hints_at_momentum_and_names_the_state_part():
  with pytest.raises(ValueError, match=r"`state\.rest` is not a state.*built without momentum"):
    _fit.check(_state({"d": 2}, trace=True), _state({"d": 2}), "kfac", "state.rest")
  with pytest.raises(ValueError, match="built with momentum, this front has none"):
    _fit.check(_state({"d": 2}), _state({"d": 2}, trace=True), "kfac")


def test_describe_reads_blocks_and_drops_nnx_value_wrappers():
  path = (
    jax.tree_util.GetAttrKey("curvature"),
    jax.tree_util.GetAttrKey("factors"),
    jax.tree_util.DictKey("params/Dense_0"),
    jax.tree_util.GetAttrKey("a"),
    jax.tree_util.GetAttrKey("value"),
  )
  assert _fit.describe(path) == (
    "curvature/factors/params/Dense_0/a",
    "params/Dense_0",
    "factors/a",
  )

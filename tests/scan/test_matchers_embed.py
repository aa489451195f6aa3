"""Embeddings written as one-hot products: found as embedding layers, same block as a gather."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_jax
from kfac_jax import _curvature
from kfac_jax.scan import _scanner
from tests import _models

V, D, C = 7, 3, 4


def _ce_seq(logits, y):
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum(-1).mean()


def _params(seed=0, dtype=jnp.float64):
  rng = _models.np_rng(seed)
  return jax.device_put(
    {
      "table": rng.standard_normal((V, D)).astype(dtype),
      "w": rng.standard_normal((D, C)).astype(dtype),
    }
  )


def _ids_and_labels(seed, shape, classes=C):
  """`{"ids": [*shape] in [0, V), "y": [*shape] in [0, classes)}`, drawn on the host."""
  rng = _models.np_rng(seed)
  ids, y = rng.integers(0, V, shape), rng.integers(0, classes, shape)
  return jax.device_put({"ids": ids.astype(np.int32), "y": y.astype(np.int32)})


def _seq_batch(seed=1, n=5, length=3):
  return _ids_and_labels(seed, (n, length))


# Lookups `h = table[ids]` written in several ways; float64 throughout except where cast.
LOOKUPS = {
  "gather": lambda t, ids: t[ids],
  "one_hot_matmul": lambda t, ids: jax.nn.one_hot(ids, V, dtype=t.dtype) @ t,
  "one_hot_dot_cast": lambda t, ids: jnp.dot(
    jax.nn.one_hot(ids, V, dtype=jnp.float32).astype(t.dtype), t
  ),
  "einsum_eq_iota": lambda t, ids: jnp.einsum(
    "nlv,vd->nld", (ids[..., None] == jnp.arange(V)).astype(t.dtype), t
  ),
  "numpy_arange": lambda t, ids: (ids[..., None] == np.arange(V)).astype(t.dtype) @ t,
  # equinox's `Embedding` reads `table[i]` for one token: a `dynamic_slice` that `vmap` turns
  # into a clipped full-row gather and a `squeeze`.
  "vmap_row": lambda t, ids: _vmap_rows(t, ids),
}


def _vmap_rows(t, ids):
  row = lambda i: t[i]  # noqa: E731
  for _ in range(ids.ndim):
    row = jax.vmap(row)
  return row(ids)


def _loss(lookup):
  return lambda p, b: _ce_seq(LOOKUPS[lookup](p["table"], b["ids"]) @ p["w"], b["y"])


def _estimate(loss_fn, params, batch, mode="gradients"):
  # `check_loss=False`: the loss audit is tested in tests/test_audit.py and the zoo; here it
  # would only compile another program.
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode=mode, check_loss=False)
  )

  @jax.jit  # One program: called eagerly, each small operation compiles on its own.
  def run(p, b):
    state = est.update_curvature(est.init(p), p, b, jax.random.key(0), ema_decay=0.0)
    return state, est.to_dense(state)

  state, dense = run(params, batch)
  return est, state, np.asarray(dense)


@functools.cache  # Shared by every lookup below (all float64).
def _gather_estimate():
  """(G factor of `table`, dense estimate) of the plain gather on `_params()`, `_seq_batch()`."""
  _, state, dense = _estimate(_loss("gather"), _params(), _seq_batch())
  return np.asarray(state.factors["table"].g), dense


@pytest.mark.parametrize("lookup", sorted(set(LOOKUPS) - {"gather"}))
def test_one_hot_product_is_an_embedding_with_the_gather_block(x64, lookup):
  params, batch = _params(), _seq_batch()
  layers = kfac_jax.Registration(_loss(lookup), params, batch, strict=True, check_loss=False).layers
  assert [(l.name, l.kind, l.factor_shapes) for l in layers] == [
    ("table", "embedding", ((V,), (D, D))),
    ("w", "dense", ((D, D), (C, C))),
  ]
  gather_g, want = _gather_estimate()
  _, state_o, got = _estimate(_loss(lookup), params, batch)
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-13)
  counts = np.bincount(np.asarray(batch["ids"]).ravel(), minlength=V) / batch["ids"].size
  np.testing.assert_allclose(state_o.factors["table"].a, counts, rtol=1e-12)
  np.testing.assert_allclose(state_o.factors["table"].g, gather_g, rtol=1e-10)


def test_one_hot_product_in_low_precision_is_an_embedding():
  """A bf16 one-hot times a bf16 cast of the table, through einsum: still a lookup."""
  params, batch = _params(dtype=jnp.float32), _seq_batch()

  def loss_fn(p, b):
    oh = jax.nn.one_hot(b["ids"], V, dtype=jnp.bfloat16)
    h = jnp.einsum("nlv,vd->nld", oh, p["table"].astype(jnp.bfloat16)).astype(jnp.float32)
    return _ce_seq(h @ p["w"], b["y"])

  (emb, _) = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert (emb.kind, emb.factor_shapes) == ("embedding", ((V,), (D, D)))


def test_one_hot_product_equals_the_manual_dense_block(x64):
  """The diagonal input factor is exact: a one-hot row's second moment is diagonal, so the
  embedding block equals the dense block of the same product (registered by hand)."""
  params, batch = _params(2), _seq_batch(3)

  def dense_loss(p, b):
    oh = jax.nn.one_hot(b["ids"], V, dtype=p["table"].dtype)
    h = kfac_jax.register_dense(oh @ p["table"], oh, p["table"])
    return _ce_seq(h @ p["w"], b["y"])

  (manual, _) = kfac_jax.Registration(
    dense_loss, params, batch, strict=True, check_loss=False
  ).layers
  assert (manual.kind, manual.factor_shapes) == ("dense", ((V, V), (D, D)))
  _, _, want = _estimate(dense_loss, params, batch)
  _, _, got = _estimate(_loss("one_hot_matmul"), params, batch)
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-13)


def test_one_hot_embedding_block_equals_the_exact_fisher_for_one_example(x64):
  """One example, one id: F = Jᵀ H J exactly (exact mode), and the K-FAC block is that block."""
  params = _params(4)
  batch = jax.device_put({"ids": np.array([5], np.int32), "y": np.array([2], np.int32)})

  def logits_fn(p, ids):
    return jax.nn.one_hot(ids, V, dtype=p["table"].dtype) @ p["table"] @ p["w"]

  def loss_fn(p, b):
    logits = logits_fn(p, b["ids"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  est, _, dense = _estimate(loss_fn, params, batch, mode="exact")
  assert est.layers[0].kind == "embedding"
  flat, unravel = ravel_pytree(params)
  jac = np.asarray(
    _models.jit_jacobian(lambda f, ids: logits_fn(unravel(f), ids)[0])(flat, batch["ids"])
  )
  prob = np.asarray(
    jax.jit(lambda p, ids: jax.nn.softmax(logits_fn(p, ids)[0]))(params, batch["ids"])
  )
  fisher = jac.T @ (np.diag(prob) - np.outer(prob, prob)) @ jac
  n = V * D
  np.testing.assert_allclose(dense[:n, :n], fisher[:n, :n], rtol=1e-9, atol=1e-12)
  assert np.abs(fisher[:n, :n]).max() > 1e-3


def test_one_hot_embedding_summary_and_memory_are_linear_in_vocab():
  vocab, dim = 2000, 4
  params = {"table": jnp.zeros((vocab, dim)), "w": jnp.zeros((dim, C))}
  batch = {"ids": jnp.array([[1, 2], [3, 1999]]), "y": jnp.zeros((2, 2), jnp.int32)}

  def loss_fn(p, b):
    return _ce_seq(jax.nn.one_hot(b["ids"], vocab) @ p["table"] @ p["w"], b["y"])

  table = kfac_jax.summary(
    registration=kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False)
  )
  line = next(r for r in table.splitlines() if r.startswith("table "))
  assert line.split()[1:6] == ["embedding", "1", "kron", "table", f"{vocab}"]
  assert line.split()[6] == f"{dim}x{dim}"
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, check_loss=False), compute_cholesky=True
  )
  state = jax.eval_shape(est.init, params)  # Sizes only.
  floats = sum(
    x.size for x in jax.tree_util.tree_leaves((state.factors["table"], state.cache["table"]))
  )
  # Factors, inverse powers and Cholesky factors: a few vectors of `vocab` and matrices of dim².
  assert floats <= 4 * (vocab + dim * dim) + 1
  assert floats < vocab * vocab / 100


@pytest.mark.parametrize(
  "case", ["greater_than", "transposed_one_hot", "table_on_the_left", "float_ids"]
)
def test_products_that_are_not_lookups_stay_dense(case):
  params = {"table": jnp.ones((V, D)), "w": jnp.ones((D, C))}
  batch = {"ids": jnp.array([1, 2]), "y": jnp.array([0, 1]), "f": jnp.array([1.0, 2.0])}
  h = {
    "greater_than": lambda p, b: (
      (b["ids"][:, None] > jnp.arange(V)).astype(jnp.float32) @ p["table"]
    ),
    "transposed_one_hot": lambda p, b: jax.nn.one_hot(b["ids"], V, axis=0).T @ p["table"],
    "table_on_the_left": lambda p, b: (p["table"].T @ jax.nn.one_hot(b["ids"], V).T).T,
    "float_ids": lambda p, b: (b["f"][:, None] == jnp.arange(V)).astype(jnp.float32) @ p["table"],
  }[case]

  def loss_fn(p, b):
    logits = h(p, b) @ p["w"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  layers = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert [(l.name, l.kind) for l in layers] == [("table", "dense"), ("w", "dense")]


@pytest.mark.parametrize("case", ["part_of_a_row", "two_rows"])
def test_vmapped_slices_that_are_not_row_lookups_are_not_embeddings(case):
  """Only a whole single row read per id is a lookup; other vmapped dynamic slices are not."""
  params = {"table": jnp.ones((V, D)), "w": jnp.ones((D - 1, C))}
  batch = {"ids": jnp.array([1, 2]), "y": jnp.array([0, 1])}
  row = {
    "part_of_a_row": lambda t, i: jax.lax.dynamic_slice(t, (i, 1), (1, D - 1))[0],
    "two_rows": lambda t, i: jax.lax.dynamic_slice(t, (i, 0), (2, D)).sum(0)[1:],
  }[case]

  def loss_fn(p, b):
    logits = jax.vmap(lambda i: row(p["table"], i))(b["ids"]) @ p["w"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  with pytest.warns(kfac_jax.UncoveredParametersWarning):
    layers = kfac_jax.Registration(loss_fn, params, batch).layers
  assert [(l.name, l.kind) for l in layers] == [("table", "generic"), ("w", "dense")]


def test_ids_outside_the_vocabulary_are_not_counted(x64):
  """`one_hot(-1)` and `one_hot(V)` are zero rows: they add no count to the input factor."""
  params = _params(5)
  batch = {"ids": jnp.array([[0, -1, 3], [V, 3, 3]]), "y": jnp.zeros((2, 3), jnp.int32)}
  _, state, _ = _estimate(_loss("one_hot_matmul"), params, batch, mode="empirical")
  want = np.zeros(V)
  want[0], want[3] = 1 / 6, 3 / 6
  np.testing.assert_allclose(state.factors["table"].a, want, rtol=1e-12)


def test_tied_one_hot_embedding_is_one_shared_layer_like_the_gather(x64):
  """One-hot lookup plus logits `h tableᵀ`: one two-use embedding, factors as the gather's."""
  params = {"table": _models.normal(6, (V, D), jnp.float64)}
  batch = _ids_and_labels(7, (4,), classes=V)

  def make(lookup):
    def loss_fn(p, b):
      logits = jnp.tanh(LOOKUPS[lookup](p["table"], b["ids"])) @ p["table"].T
      kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    return loss_fn

  factors = {}
  for lookup in ("gather", "one_hot_matmul", "vmap_row"):
    loss_fn = make(lookup)
    (spec,) = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
    assert (spec.kind, spec.num_uses, spec.factor_shapes) == ("embedding", 2, ((V,), (D, D)))
    scan = _scanner.scan(loss_fn, params, batch)
    config = kfac_jax.blocks.BlockConfig(stats_dtype=jnp.float64, inverse_dtype=jnp.float64)
    block = kfac_jax.blocks.make_block(spec, config)

    @jax.jit  # One program: called eagerly, each small operation compiles on its own.
    def batch_factors(p, b, scan=scan, block=block):
      _, _, stats = _curvature.compute(
        scan, p, b, None, estimation_mode="empirical", num_samples=1, with_grads=False
      )
      return block.batch_factors(stats.data[0], 4)

    factors[lookup] = batch_factors(params, batch)
  for lookup in ("one_hot_matmul", "vmap_row"):
    for k in ("a", "g"):
      np.testing.assert_allclose(
        getattr(factors[lookup], k), getattr(factors["gather"], k), rtol=1e-10
      )


# Plain gathers in other spellings: one id per example (no sequence axis), and `jnp.take`
# (a gather inside a nested jit, whose default mode fills out-of-range rows where `table[ids]`
# promises in-bounds ids).
GATHERS = {
  "getitem_ids_B": (lambda t, ids: t[ids], (6,)),
  "take_ids_BT": (lambda t, ids: jnp.take(t, ids, axis=0), (4, 3)),
}


@pytest.mark.parametrize("case", sorted(GATHERS))
def test_gather_lookup_preconditions_like_the_one_hot_product(x64, case):
  """The gather is an embedding layer, and exact mode's preconditioned gradient is the one of
  the same model written `one_hot(ids) @ table`."""
  lookup, ids_shape = GATHERS[case]
  params = _params(9)
  batch = _ids_and_labels(10, ids_shape)

  def make(h):
    def loss_fn(p, b):
      logits = jnp.tanh(h(p["table"], b["ids"])) @ p["w"]
      kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    return loss_fn

  losses = {"gather": make(lookup), "one_hot": make(LOOKUPS["one_hot_matmul"])}
  for loss_fn in losses.values():
    layers = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
    assert [(l.name, l.kind, l.factor_shapes) for l in layers] == [
      ("table", "embedding", ((V,), (D, D))),
      ("w", "dense", ((D, D), (C, C))),
    ]
  grads, gather_grads = jax.jit(
    lambda p, b: (jax.grad(losses["one_hot"])(p, b), jax.grad(losses["gather"])(p, b))
  )(params, batch)
  flat_grads = np.asarray(ravel_pytree(grads)[0])
  np.testing.assert_allclose(ravel_pytree(gather_grads)[0], flat_grads)
  nat = {}
  for name, loss_fn in losses.items():
    est = kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact", check_loss=False)
    )

    @jax.jit
    def precondition(params, est=est):
      state = est.init(params)
      state = est.update_curvature(state, params, batch, jax.random.key(0), ema_decay=0.0)
      return est.multiply_inverse(est.update_inverses(state, 1e-3), grads)

    nat[name] = np.asarray(ravel_pytree(precondition(params))[0])
  np.testing.assert_allclose(nat["gather"], nat["one_hot"], rtol=1e-9, atol=1e-12)
  assert not np.allclose(nat["gather"], flat_grads, rtol=1e-2)  # Really preconditioned.

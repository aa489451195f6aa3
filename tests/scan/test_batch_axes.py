"""`_batch_axes`: the batch axis of each value, followed from the batch inputs through the
equations (the matchers group a layer's rows by it; exactness on models is in test_scanner)."""

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax.scan import _batch_axes, _graph

N, T, D = 3, 4, 2


def _tags(fn, params, batch):
  """The followed `(axis, inner)` of each output of `fn(params, batch)` (None: not followed)."""
  closed = jax.make_jaxpr(fn)(params, batch)
  n_params = len(jax.tree_util.tree_leaves(params))
  graph = _graph.FlatGraph.from_closed_jaxpr(closed, n_params)
  tags = _batch_axes.batch_axes(graph, n_params, N)
  return [tags.get(a) if _graph.is_key(a) else None for a in graph.outvars]


def test_axes_are_followed_through_moves_merges_and_lookups():
  params = {"w": jnp.ones((D, 5)), "table": jnp.ones((7, D)), "k": jnp.ones((3, 3, D, 4))}
  batch = {
    "x": jnp.ones((N, T, D)),
    "ids": jnp.zeros((N, T), jnp.int32),
    "idx": jnp.zeros((N, 2, 1), jnp.int32),
    "img": jnp.ones((N, 6, 6, D)),
  }

  def fn(p, b):
    x = b["x"]
    conv = lax.conv_general_dilated(
      b["img"], p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return (
      x @ p["w"],  # a dense layer's output keeps the batch axis
      jnp.swapaxes(x, 0, 1),  # time-major: axis 1
      x.reshape(N * T, D),  # (b t) d: axis 0, each example's 4 rows together
      jnp.swapaxes(x, 0, 1).reshape(T * N, D),  # (t b) d: the examples interleaved
      x.reshape(N * T, D).reshape(N, T * D),  # split again: the batch itself
      x.sum(0),  # summed over the examples
      jnp.einsum("ntd,mtd->nm", x, x),  # examples against examples
      p["table"][b["ids"]],  # a lookup at per-example ids
      jnp.take_along_axis(x, b["idx"], axis=1),  # a per-example gather
      conv,  # the convolution's batch dimension
      x[:, 1:3],  # a slice that keeps every example
      jnp.concatenate([x, x], axis=1),  # joined along another axis
      jnp.sort(x, axis=1),  # sorted within each example
      jnp.cumsum(x, axis=0),  # accumulated across the examples
      p["w"] * 2.0,  # no batch input
    )

  assert _tags(fn, params, batch) == [
    (0, 1),
    (1, 1),
    (0, T),
    None,
    (0, 1),
    None,
    None,
    (0, 1),
    (0, 1),
    (0, 1),
    (0, 1),
    (0, 1),
    (0, 1),
    None,
    None,
  ]


def test_a_time_major_batch_leaf_and_an_unrolled_scan_over_it():
  """A batch leaf `[T, N, D]` (only its axis 1 has the batch's size) and a scan over its
  leading axis that reads a parameter (unrolled by the graph): each step's slice has the batch
  first, and the stacked outputs have it at axis 1 again."""
  params = {"w": jnp.ones((D, D))}
  batch = {"x": jnp.ones((T, N, D))}

  def fn(p, b):
    def step(h, x):
      h = jnp.tanh(x @ p["w"] + h)
      return h, h

    return lax.scan(step, jnp.zeros((N, D)), b["x"])

  assert _tags(fn, params, batch) == [(0, 1), (1, 1)]


def test_elementwise_broadcasting_keeps_the_batched_operands_axis():
  """`jax.vmap` gives a value computed once for all examples a unit batch axis and lets an
  elementwise equation broadcast it against a batched operand (a tangent direction times the
  derivative at each point): the result has that operand's batch axis."""
  params = {"v": jnp.ones((T, D))}
  batch = {"x": jnp.ones((N, D))}

  def fn(p, b):
    return (b["x"][:, None, :] * p["v"][None], p["v"][None] - b["x"][:, None, :])

  assert _tags(fn, params, batch) == [(0, 1), (0, 1)]

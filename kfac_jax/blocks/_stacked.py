"""A stack of L layers of one kind (`kfac_jax.scan._stacked`): the per-layer block, vmapped.

Every statistic, cache entry and product of the layer's own block (`spec.stack_inner`) gains a
leading axis L, as do the parameter leaves; the curvature is block-diagonal over the stack.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kfac_jax.blocks._base import Block, StackedUses, map_factorisations


class StackedBlock(Block):
  """L copies of the block of `spec.stack_inner`, with state stacked on a leading axis."""

  def __init__(self, spec, config, inner: Block):
    self.spec, self.config, self.inner = spec, config, inner
    wrapped: Block | None = inner
    while wrapped is not None:  # The stack vmaps its block and whatever that block wraps.
      wrapped.vmapped = True
      wrapped = getattr(wrapped, "inner", None)
    self.needs_cache_for_statistics = inner.needs_cache_for_statistics

  @classmethod
  def factor_shapes_for(cls, spec):
    """The factor shapes of one layer (`spec.stack_inner`) with a leading stack axis L."""
    return tuple((spec.stack_size, *s) for s in spec.stack_inner.factor_shapes)

  def _stack(self, tree):
    """`tree` broadcast along a leading stack axis L."""
    size = self.spec.stack_size
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (size,) + x.shape), tree)

  def group_key(self) -> tuple:
    return ("StackedBlock", self.spec.stack_size) + self.inner.group_key()

  def init_factors(self):
    return self._stack(self.inner.init_factors())

  def accepts_stacked_uses(self) -> bool:
    return True

  def batch_factors(self, data, batch_size, cache=None):
    if isinstance(data, StackedUses):  # One tap per layer, stacked by the scan.
      inputs, g = data.inputs, jnp.moveaxis(data.g, 1, 0)
      vmap_axes: tuple[int | None, ...] = (0,) * len(inputs)
    elif self.spec.stack_axes:  # One batched use: move the layer axis to the front.
      inputs, g = data
      in_axes, out_axis = self.spec.stack_axes[:-1], self.spec.stack_axes[-1]
      # An input axis of -1: the input is shared by every layer of the stack.
      inputs = tuple(x if a < 0 else jnp.moveaxis(x, a, 0) for x, a in zip(inputs, in_axes))
      vmap_axes = tuple(None if a < 0 else 0 for a in in_axes)
      g = jnp.moveaxis(g, 1 + out_axis, 0)
    else:  # One tap per layer (a scan over the stack), in layer order.
      inputs = tuple(jnp.stack(xs) for xs in zip(*[d[0] for d in data]))
      vmap_axes = (0,) * len(inputs)
      g = jnp.stack([d[1] for d in data])
    return jax.vmap(
      lambda x, gg, c: self.inner.batch_factors((x, gg), batch_size, c), in_axes=(vmap_axes, 0, 0)
    )(inputs, g, cache)

  def init_cache(self):
    return self._stack(self.inner.init_cache())

  def compute_cache(self, factors, damping):
    return map_factorisations(lambda f: self.inner.compute_cache(f, damping), factors)

  def multiply_matpower(self, factors, cache, vecs, exp):
    fn = functools.partial(self.inner.multiply_matpower, exp=exp)
    return jax.vmap(fn)(factors, cache, list(vecs))

  def multiply_cholesky(self, factors, cache, vecs, *, transpose, inverse):
    fn = functools.partial(self.inner.multiply_cholesky, transpose=transpose, inverse=inverse)
    return jax.vmap(fn)(factors, cache, list(vecs))

  def multiply_undamped(self, factors, vecs, cache=None):
    return jax.vmap(self.inner.multiply_undamped)(factors, list(vecs), cache)

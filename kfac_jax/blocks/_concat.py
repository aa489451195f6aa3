"""A layer over concatenated parameter leaves (Flax's `OptimizedLSTMCell` concatenates its gate
kernels into one before a single product, `_specs.ConcatView`): the concatenation is a linear,
invertible relayout of the leaves, so the block of the concatenated kernel is the leaves' block,
its products joining the pieces and splitting the result back."""

from __future__ import annotations

from kfac_jax import _specs
from kfac_jax.blocks._base import Block


class ConcatBlock(Block):
  """The `inner` block of `spec.logical`, acting on `spec`'s real (concatenated) leaves."""

  def __init__(self, spec, config, inner: Block):
    self.spec, self.config, self.inner = spec, config, inner
    self.needs_cache_for_statistics = inner.needs_cache_for_statistics

  @classmethod
  def factor_shapes_for(cls, spec):
    """The factor shapes of the layer as matched on the concatenations (`spec.logical`)."""
    return spec.logical.factor_shapes

  def group_key(self) -> tuple:
    return self.inner.group_key()

  def _join(self, vecs):
    it = iter(vecs)
    return [
      next(it) if view is None else _specs.join_pieces(view, [next(it) for _ in view.leaves])
      for view in self.spec.concat
    ]

  def _split(self, logical):
    out: list = []
    k = 0
    for view, x in zip(self.spec.concat, logical):
      n = 1 if view is None else len(view.leaves)
      shapes = self.spec.param_shapes[k : k + n]
      out.extend([x] if view is None else _specs.split_pieces(view, x, shapes))
      k += n
    return out

  def init_factors(self):
    return self.inner.init_factors()

  def batch_factors(self, data, batch_size, cache=None):
    return self.inner.batch_factors(data, batch_size, cache)

  def init_cache(self):
    return self.inner.init_cache()

  def compute_cache(self, factors, damping):
    return self.inner.compute_cache(factors, damping)

  def multiply_matpower(self, factors, cache, vecs, exp):
    return self._split(self.inner.multiply_matpower(factors, cache, self._join(vecs), exp))

  def multiply_cholesky(self, factors, cache, vecs, *, transpose, inverse):
    joined = self._join(vecs)
    out = self.inner.multiply_cholesky(factors, cache, joined, transpose=transpose, inverse=inverse)
    return self._split(out)

  def multiply_undamped(self, factors, vecs, cache=None):
    return self._split(self.inner.multiply_undamped(factors, self._join(vecs), cache))

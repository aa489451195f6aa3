"""The shared-layer matcher: one layer for a leaf with several real uses (tied weights, a scan's
steps), when the kinds' use readers agree on how the leaf is read. It sits above both matcher
modules: a tied embedding mixes lookups with products by the (transposed) table.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kfac_jax._specs import ConvInfo, DenseInfo, EmbeddingInfo, Kind, kernel_index_matrix
from kfac_jax.scan import _graph, _matchers, _matchers_embed


def match_shared(ix, leaf, claimed, shifts: bool = False):
  """A `Match` per use of a leaf used only by dense products, lookups, convolutions or scales."""
  found: list[tuple] = []  # (kind, info, inputs, out_key, bias / shift leaf or None)
  products = {}  # Position in `found` of a dense use -> its product's output key.
  for i, pos in ix.uses[leaf]:
    use = _use(ix, i, pos, claimed, shifts) if len(ix.uses_by_eqn.get(i, [])) == 1 else None
    if use is None:
      return None
    if use[0] == "dense":
      products[len(found)] = ix.g.eqns[i].outs[0]
    found.append(use)
  kinds = {f[0] for f in found}
  if kinds == {"dense"}:
    found = _transposed_uses(found, ix.shapes[leaf], products)
    if found is None:
      return None
  for n in products:  # A dense use whose input is the same for every example.
    x_atom, out_key, info = found[n][2][0], found[n][3], found[n][1]
    if _graph.is_key(x_atom) and x_atom in ix.param_only:
      tap = _matchers.constant_input_tap(ix, out_key, info)
      if tap is None:
        return None  # No output gradient per example.
      found[n] = (found[n][0], tap[1], found[n][2], tap[0], found[n][4])
  found, b_leaf = _tangent_uses(ix, found, kinds)
  if b_leaf is False or b_leaf in claimed:  # Disagreeing uses, or a bias claimed already.
    return None
  infos, shape = tuple(f[1] for f in found), ix.shapes[leaf]
  kind: Kind = "embedding" if "embedding" in kinds else found[0][0]
  if kind == "embedding":
    if not kinds <= {"dense", "embedding"} or not _reads_one_table(infos, shape):
      return None
  elif len(kinds) != 1 or len({_layout(inf, shape) for inf in infos}) != 1:
    return None
  leaves = [leaf] + ([b_leaf] if b_leaf is not None else [])
  return _matchers.Match(
    kind, tuple(leaves), infos, tuple(f[3] for f in found), tuple(f[2] for f in found)
  )


def _use(ix, i, pos, claimed, shifts):
  """`(kind, info, inputs, output key, bias / shift leaf or None)` of one use, or None."""
  fe = ix.g.eqns[i]
  m = _matchers_embed.one_hot_embedding_use(ix, i) if pos == 1 else None
  if m is None and fe.name == "gather" and pos == 0:
    m = _matchers_embed.embedding_use(ix, i)
  if m is None and fe.name == "dot_general":
    d = _matchers.dense_use(ix, i, pos)
    if d is None:
      return None
    info, x_atom, k_shape, k_free = d
    bias = _matchers.match_dense_bias(ix, fe.outs[0], pos, k_shape, k_free, claimed, shared=True)
    b_leaf, out_key = bias if bias is not None else (None, fe.outs[0])
    return "dense", info, (x_atom,), out_key, b_leaf
  if m is None and fe.name == "conv_general_dilated":
    m = _matchers.match_conv(ix, i, claimed, shared=True)
  elif m is None and (fe.name == "mul" or (fe.name == "add" and shifts)):
    m = _matchers.match_scale_and_shift(ix, i, claimed, shared=True)
  if m is None:
    return None
  extra = m.leaves[1] if len(m.leaves) > 1 else None
  return m.kind, m.infos[0], m.inputs[0], m.outputs[0], extra


def _tangent_uses(ix, found, kinds):
  """`(found, bias leaf or None)` when the uses agree on the bias, else `(found, False)`; dense
  uses without it (tangents: `x W + b` along `dx` is `dx W`) are marked `adds_bias=False`."""
  biases = {f[4] for f in found}
  mixed = len(biases) == 2 and None in biases and kinds == {"dense"}
  if len(biases) != 1 and not mixed:
    return found, False
  b_leaf = next((b for b in biases if b is not None), None)
  if b_leaf is None:
    return found, None
  if len(ix.uses[b_leaf]) != sum(f[4] is not None for f in found):
    return found, False
  if not mixed:
    return found, b_leaf
  marked = [
    f if f[4] is not None else (f[0], dataclasses.replace(f[1], adds_bias=False), *f[2:])
    for f in found
  ]
  return marked, b_leaf


def _transposed_uses(found, shape, products):
  """`found` with the uses reading the kernel matrix (the bias-adding uses' reading) transposed
  (`δa = δz Wᵀ`) marked `transposed`, tapped at their product; None for any other reading."""
  mats = [kernel_index_matrix(f[1], shape) for f in found]
  first = next((n for n, f in enumerate(found) if f[4] is not None), 0)
  canonical = mats[first]
  out = []
  for n, (f, m) in enumerate(zip(found, mats)):
    if np.array_equal(m, canonical):
      out.append(f)
    elif m.shape == canonical.T.shape and np.array_equal(m, canonical.T):
      info = dataclasses.replace(f[1], transposed=True)
      out.append((f[0], info, f[2], products[n], None))
    else:
      return None
  return out


def _layout(info, shape) -> tuple:
  """What the uses of a shared dense, conv or scale-and-shift leaf must agree on."""
  if isinstance(info, DenseInfo):
    m = kernel_index_matrix(info, shape)
    m = m.T if info.transposed else m
    return m.shape, m.tobytes()
  if isinstance(info, ConvInfo):
    names = "kernel_view rhs_spec feature_group_count kernel_spatial in_channels out_channels"
    return tuple(getattr(info, name) for name in names.split())
  return info.has_scale, info.has_shift, info.feature_shape, info.feature_axis, info.batch_axis


def _reads_one_table(infos, shape) -> bool:
  """Whether the uses read one `[vocab, dim]` table: one lookup, products by it or its transpose."""
  idx = np.arange(math.prod(shape)).reshape(shape)
  lookups = {inf for inf in infos if isinstance(inf, EmbeddingInfo)}
  products = [kernel_index_matrix(inf, shape) for inf in infos if isinstance(inf, DenseInfo)]
  return len(lookups) == 1 and all(
    np.array_equal(m, idx) or np.array_equal(m, idx.T) for m in products
  )

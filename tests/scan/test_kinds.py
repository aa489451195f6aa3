"""The layer vocabulary: one record per kind, block classes that declare what they serve."""

from typing import get_args

import pytest

import kfac_jax
from kfac_jax import blocks
from kfac_jax._specs import ScaleShiftInfo
from kfac_jax.scan import _kinds


def test_every_kind_has_one_record_and_only_those():
  assert tuple(_kinds.KINDS) == get_args(_kinds.Kind)
  for name, record in _kinds.KINDS.items():
    assert record.name == name
    assert record.approximations, name
    if hasattr(kfac_jax, f"register_{name}"):  # A manual tag is read by its kind's record.
      assert record.read_tag is not None, f"{name} has no manual tag reader"


def test_every_named_pair_has_exactly_one_block_and_every_block_pair_is_named():
  named = {(k.name, a) for k in _kinds.KINDS.values() for a in k.approximations + k.shared}
  served = [pair for cls in blocks.BLOCK_CLASSES for pair in cls.serves]
  assert len(served) == len(set(served)), "a pair is served by two block classes"
  assert named == set(served), (sorted(named - set(served)), sorted(set(served) - named))


def test_approximations_are_a_literal_and_all_of_them_are_used():
  assert set(_kinds.every_approximation()) == set(get_args(_kinds.Approximation))
  assert set(_kinds.SERIES) <= set(_kinds.KINDS["dense"].shared)


def test_the_passes_run_kernels_before_gathers_before_elementwise():
  kernels, gathers, elementwise = _kinds.passes()
  names = [[f.__name__ for f in p] for p in (kernels, gathers, elementwise)]
  assert names[0].index("match_one_hot_embedding") < names[0].index("match_dense")
  assert names[1] == ["match_embedding"]
  assert names[2][-1] == "match_batch_tokens"


def test_the_default_is_the_first_approximation_unless_the_shape_says_otherwise():
  assert _kinds.default_approx("dense", None) == ("kron", "")
  table = ScaleShiftInfo(False, True, feature_shape=(4, 8), output_shape=(2, 4, 8))
  approx, note = _kinds.default_approx("scale_and_shift", table)
  assert approx == "diagonal" and "4x8" in note
  vector = ScaleShiftInfo(True, True, feature_shape=(8,), output_shape=(2, 8))
  assert _kinds.default_approx("scale_and_shift", vector) == ("full", "")


def test_an_unknown_kind_is_named_with_the_choices():
  with pytest.raises(ValueError, match=r"unknown layer kind 'dens'.*'dense'"):
    kfac_jax.LayerConfig(defaults={"dens": "kron"})

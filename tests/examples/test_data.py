"""Tests for examples/data.py: idx parsing (gzip and plain) and the digits fallback."""

import gzip
import os
import struct
import sys

import numpy as np
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from examples import data  # noqa: E402


def _idx_bytes(arr: np.ndarray) -> bytes:
  assert arr.dtype == np.uint8
  header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim)
  header += struct.pack(">" + "I" * arr.ndim, *arr.shape)
  return header + arr.tobytes()


def _write(path, payload: bytes, compress: bool):
  if compress:
    with gzip.open(path, "wb") as f:
      f.write(payload)
  else:
    with open(path, "wb") as f:
      f.write(payload)


def _fake_split(n=5, h=4, w=3, seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, size=(n, h, w), dtype=np.uint8)
  images[0, 0, 0] = 255
  images[0, 0, 1] = 0
  labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
  return images, labels


@pytest.mark.parametrize(
  "compress,style", [(True, "dash"), (False, "dash"), (False, "dot"), (True, "dot")]
)
def test_load_idx_pair(tmp_path, compress, style):
  images, labels = _fake_split()
  ext = ".gz" if compress else ""
  if style == "dash":
    img_name, lbl_name = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"
  else:
    img_name, lbl_name = "train-images.idx3-ubyte", "train-labels.idx1-ubyte"
  _write(tmp_path / (img_name + ext), _idx_bytes(images), compress)
  _write(tmp_path / (lbl_name + ext), _idx_bytes(labels), compress)

  x, y = data.load_fashion_mnist(data_dir=tmp_path, split="train")
  assert x.shape == (5, 12) and x.dtype == np.float32
  assert y.shape == (5,) and y.dtype == np.int32
  np.testing.assert_allclose(x, images.reshape(5, -1).astype(np.float32) / 255.0, rtol=1e-6)
  np.testing.assert_array_equal(y, labels.astype(np.int32))
  assert x.min() >= 0.0 and x.max() <= 1.0
  assert x[0, 0] == 1.0 and x[0, 1] == 0.0


def test_load_dataset_from_env_dir(tmp_path, monkeypatch):
  images, labels = _fake_split(n=7, h=4, w=4, seed=1)
  _write(tmp_path / "train-images-idx3-ubyte.gz", _idx_bytes(images), True)
  _write(tmp_path / "train-labels-idx1-ubyte.gz", _idx_bytes(labels), True)
  monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path))
  ds = data.load_dataset()
  assert not ds.fallback
  assert ds.train_images.shape == (7, 16)
  assert ds.image_shape == (4, 4)
  assert str(tmp_path) in ds.source
  np.testing.assert_array_equal(ds.train_labels, labels.astype(np.int32))


def test_explicit_dir_beats_env(tmp_path, monkeypatch):
  images, labels = _fake_split(n=3)
  good = tmp_path / "good"
  good.mkdir()
  _write(good / "train-images-idx3-ubyte", _idx_bytes(images), False)
  _write(good / "train-labels-idx1-ubyte", _idx_bytes(labels), False)
  monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path / "missing"))
  x, _ = data.load_fashion_mnist(data_dir=good)
  assert x.shape == (3, 12)


def test_bad_magic_raises(tmp_path):
  path = tmp_path / "train-images-idx3-ubyte"
  path.write_bytes(b"\x01\x02\x08\x03" + b"\x00" * 12)
  with pytest.raises(ValueError, match="magic"):
    data.read_idx(str(path))


def test_truncated_raises(tmp_path):
  images, _ = _fake_split()
  path = tmp_path / "x-idx3-ubyte"
  path.write_bytes(_idx_bytes(images)[:-3])
  with pytest.raises(ValueError, match="expected"):
    data.read_idx(str(path))


@pytest.mark.parametrize("via_env", [True, False])
def test_fallback_to_digits(tmp_path, monkeypatch, capsys, via_env):
  empty = tmp_path / "empty"
  empty.mkdir()
  if via_env:
    monkeypatch.setenv(data.DATA_DIR_ENV, str(empty))
    ds = data.load_dataset()
  else:
    monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
    ds = data.load_dataset(data_dir=empty)
  assert ds.fallback and ds.name == "digits"
  assert ds.train_images.shape == (1797, 64)
  assert ds.train_images.dtype == np.float32
  assert ds.train_images.min() >= 0.0 and ds.train_images.max() == 1.0
  assert ds.image_shape == (8, 8)
  assert "load_digits" in ds.source and "FALLBACK" in ds.source
  err = capsys.readouterr().err
  assert "falling back" in err
  assert str(empty) in err  # says which paths were tried
  assert data.DATA_DIR_ENV in err and "dataset-fashion-mnist" in err


def test_missing_files_raise_from_low_level_loader(tmp_path):
  with pytest.raises(data.IdxFilesNotFound) as info:
    data.load_fashion_mnist(data_dir=tmp_path)
  assert len(info.value.tried) == 4

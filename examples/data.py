"""Dataset loading for the examples and benchmarks. Never downloads anything.

Images come from MNIST-format idx files (Fashion-MNIST by default, but any
directory holding MNIST-style idx files works, e.g. the original MNIST). The
directory is taken from, in order:

1. the ``data_dir`` argument,
2. the ``KFAC_DATA_DIR`` environment variable,
3. ``/usr/share/datasets/fashion-mnist`` (Debian package ``dataset-fashion-mnist``).

If no idx files are found, :func:`load_dataset` falls back to scikit-learn's
bundled 8x8 ``load_digits`` images (1797 examples, 64 features) and says so.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import sys

import numpy as np

__all__ = [
  "DEFAULT_DATA_DIR",
  "DATA_DIR_ENV",
  "Dataset",
  "IdxFilesNotFound",
  "find_idx_file",
  "load_dataset",
  "load_fashion_mnist",
  "read_idx",
  "resolve_data_dir",
]

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
DATA_DIR_ENV = "KFAC_DATA_DIR"

# idx type codes -> numpy dtypes (all multi-byte types are big-endian).
_IDX_DTYPES = {
  0x08: np.dtype(np.uint8),
  0x09: np.dtype(np.int8),
  0x0B: np.dtype(">i2"),
  0x0C: np.dtype(">i4"),
  0x0D: np.dtype(">f4"),
  0x0E: np.dtype(">f8"),
}

_SPLIT_PREFIX = {"train": "train", "test": "t10k", "t10k": "t10k"}


class IdxFilesNotFound(FileNotFoundError):
  """No idx file for the requested split; ``tried`` lists the paths looked at."""

  def __init__(self, message: str, tried: list[str]):
    super().__init__(message)
    self.tried = tried


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> str:
  """Explicit argument, else ``$KFAC_DATA_DIR``, else the Debian package's directory."""
  if data_dir is not None and str(data_dir) != "":
    return os.fspath(data_dir)
  env = os.environ.get(DATA_DIR_ENV)
  if env:
    return env
  return DEFAULT_DATA_DIR


def _candidate_names(prefix: str, kind: str) -> list[str]:
  # kind is e.g. "images-idx3" or "labels-idx1".
  what, idx = kind.split("-")
  stems = [f"{prefix}-{what}-{idx}-ubyte", f"{prefix}-{what}.{idx}-ubyte"]
  return [s + ext for s in stems for ext in (".gz", "")]


def find_idx_file(data_dir: str, split: str, kind: str) -> str:
  """Path of the idx file for ``split`` ('train'/'test') and ``kind``
  ('images-idx3'/'labels-idx1')."""
  if split not in _SPLIT_PREFIX:
    raise ValueError(f"split must be one of {sorted(_SPLIT_PREFIX)}, got {split!r}")
  tried = []
  for name in _candidate_names(_SPLIT_PREFIX[split], kind):
    path = os.path.join(data_dir, name)
    tried.append(path)
    if os.path.isfile(path):
      return path
  raise IdxFilesNotFound(f"no {split} {kind} file in {data_dir!r}", tried)


def read_idx(path: str) -> np.ndarray:
  """Reads one idx file (optionally gzip-compressed) into a numpy array."""
  with open(path, "rb") as f:
    head = f.read(2)
  opener = gzip.open if head == b"\x1f\x8b" else open
  with opener(path, "rb") as f:
    raw = f.read()
  if len(raw) < 4:
    raise ValueError(f"{path}: too short to be an idx file")
  zero0, zero1, type_code, ndim = raw[0], raw[1], raw[2], raw[3]
  if zero0 != 0 or zero1 != 0 or type_code not in _IDX_DTYPES:
    raise ValueError(f"{path}: bad idx magic {raw[:4].hex()}")
  header_len = 4 + 4 * ndim
  if len(raw) < header_len:
    raise ValueError(f"{path}: truncated idx header")
  dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
  dtype = _IDX_DTYPES[type_code]
  count = int(np.prod(dims, dtype=np.int64)) if dims else 1
  expected = header_len + count * dtype.itemsize
  if len(raw) < expected:
    raise ValueError(f"{path}: expected {expected} bytes for shape {dims}, got {len(raw)}")
  data = np.frombuffer(raw, dtype=dtype, count=count, offset=header_len)
  return data.reshape(dims).astype(dtype.newbyteorder("="), copy=True)


def load_fashion_mnist(
  data_dir: str | os.PathLike | None = None, split: str = "train"
) -> tuple[np.ndarray, np.ndarray]:
  """Loads an MNIST-format split as (float32 images [N, H*W] in [0, 1], int32 labels [N]).

  Raises :class:`IdxFilesNotFound` if the directory lacks the files.
  """
  directory = resolve_data_dir(data_dir)
  images = read_idx(find_idx_file(directory, split, "images-idx3"))
  labels = read_idx(find_idx_file(directory, split, "labels-idx1"))
  if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
    raise ValueError(
      f"{directory}: unexpected idx shapes images {images.shape}, labels {labels.shape}"
    )
  scale = 255.0 if images.dtype == np.uint8 else max(float(images.max()), 1.0)
  x = images.reshape(images.shape[0], -1).astype(np.float32) / np.float32(scale)
  return x, labels.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Training split of an image dataset, flattened to [N, features] in [0, 1]."""

  train_images: np.ndarray
  train_labels: np.ndarray
  source: str  # human-readable origin, e.g. "Fashion-MNIST idx files in /usr/..."
  image_shape: tuple[int, int]
  name: str  # "fashion_mnist" or "digits"
  fallback: bool = False

  @property
  def num_features(self) -> int:
    return int(self.train_images.shape[1])

  @property
  def num_examples(self) -> int:
    return int(self.train_images.shape[0])


def _load_digits_fallback(reason: str) -> Dataset:
  from sklearn.datasets import load_digits  # bundled with scikit-learn; no network.

  digits = load_digits()
  x = digits.data.astype(np.float32) / np.float32(16.0)  # pixel values are 0..16
  y = digits.target.astype(np.int32)
  return Dataset(
    train_images=x,
    train_labels=y,
    source=f"scikit-learn load_digits (8x8, {x.shape[0]} examples) -- FALLBACK: {reason}",
    image_shape=(8, 8),
    name="digits",
    fallback=True,
  )


def load_dataset(
  name: str = "fashion_mnist", data_dir: str | os.PathLike | None = None, *, quiet: bool = False
) -> Dataset:
  """Loads the training split of ``name`` ('fashion_mnist' or 'digits').

  For 'fashion_mnist', if the idx files are missing this falls back to
  scikit-learn's digits and prints (to stderr) why and how to get the real data.
  """
  if name == "digits":
    return _load_digits_fallback("requested explicitly")
  if name not in ("fashion_mnist", "mnist", "idx"):
    raise ValueError(f"unknown dataset {name!r}")
  directory = resolve_data_dir(data_dir)
  try:
    x, y = load_fashion_mnist(directory, "train")
  except IdxFilesNotFound as e:
    reason = f"no MNIST-format idx files found in {directory!r}"
    msg = "\n".join(
      [
        f"[data] {reason}; falling back to scikit-learn's 8x8 digits (64 features).",
        "[data] tried: " + ", ".join(e.tried),
        "[data] to use Fashion-MNIST: `sudo apt-get install dataset-fashion-mnist` "
        f"(installs into {DEFAULT_DATA_DIR}), or set {DATA_DIR_ENV}=/dir/with/idx/files "
        "(or pass --data-dir).",
      ]
    )
    if not quiet:
      print(msg, file=sys.stderr, flush=True)
    return _load_digits_fallback(reason)
  side = int(round(np.sqrt(x.shape[1])))
  shape = (side, side) if side * side == x.shape[1] else (1, x.shape[1])
  return Dataset(
    train_images=x,
    train_labels=y,
    source=f"MNIST-format idx files in {directory} ({x.shape[0]} training images)",
    image_shape=shape,
    name="fashion_mnist",
    fallback=False,
  )

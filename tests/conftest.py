"""Test configuration: 8 fake CPU devices and most XLA optimisations off, set before JAX starts.

Rank promotion stays allowed globally (user models write `x @ w + b`); test_strict_numerics runs
the library's own code under `jax_numpy_rank_promotion="raise"`.
"""

import importlib.util
import mmap
import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most XLA optimisation passes off: the suite is compile-bound (hundreds of tiny programs, each
# run a few times), and this cuts its time by about a fifth. Numerics are checked against exact
# computations with tolerances, which hold either way; the scripts the suite starts in a
# subprocess inherit it. `KFAC_TEST_XLA_OPT=1` keeps the optimisations (what users run).
if os.environ.get("KFAC_TEST_XLA_OPT", "0") != "1":
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


def _jaxlib_knows(flag: str) -> bool:
  """Whether this jaxlib's XLA has `flag` (an unknown flag in XLA_FLAGS aborts the process)."""
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    return False
  path = os.path.join(spec.submodule_search_locations[0], "libjax_common.so")
  if not os.path.isfile(path):
    return False
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    return m.find(flag.encode()) >= 0


# XLA:CPU compile-speed flags, each added where this jaxlib knows it:
# - the older emitters: they compile the suite's small programs several times faster than the
#   fusion emitters, whose cost is per fusion and dominates a program that runs a few times;
# - one LLVM module per program instead of a split into parts compiled on a thread pool: each
#   part repeats the module's fixed work, and the two test processes already keep both cores
#   busy, so the split costs CPU time and gains no wall time.
if os.environ.get("KFAC_TEST_XLA_OPT", "0") != "1":
  for _flag, _value in (
    ("xla_cpu_use_fusion_emitters", "false"),
    ("xla_cpu_parallel_codegen_split_count", "1"),
  ):
    if _jaxlib_knows(_flag):
      os.environ["XLA_FLAGS"] += f" --{_flag}={_value}"

import atexit  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# JAX's persistent compilation cache, in a fresh directory per test process (each xdist worker),
# removed at exit: many tests compile the same program again (the same model and optimizer in
# another test), and this compiles each once. Nothing carries over between runs, so a run on a
# clean checkout is what CI sees; per process, so no two processes write one entry at once.
# Set through `jax.config`, not the environment, so that the scripts the suite starts in a
# subprocess (and the compile-cache benchmark's own processes) do not inherit it.
# `KFAC_TEST_COMPILE_CACHE=0` turns it off.
if os.environ.get("KFAC_TEST_COMPILE_CACHE", "1") != "0":
  _cache_dir = tempfile.mkdtemp(prefix="kfac-jax-test-xla-cache-")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", _cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_collection_finish(session):  # noqa: ARG001 - the hook's signature.
  """Python's cyclic garbage collector, set for a long run of tracing: the objects alive once
  the tests are collected (JAX, Flax and the test modules, which live to the end) move to a
  permanent generation that no collection walks again, and the youngest generation is collected
  every 20,000 allocations instead of 700 (tracing allocates many short-lived objects, and each
  full collection walked every module's objects). `KFAC_TEST_GC=0` keeps Python's defaults."""
  if os.environ.get("KFAC_TEST_GC", "1") != "0":
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


@pytest.fixture
def x64():
  """Runs a test with float64 enabled (restored afterwards)."""
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", prev)

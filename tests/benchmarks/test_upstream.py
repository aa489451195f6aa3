"""Tests for the pure helpers of benchmarks/upstream/compare.py (the upstream kfac-jax contestant).

None of this needs the upstream virtualenv or any network: parameter exchange format, step-time
summaries, loss smoothing and time-to-reach, and the curve time axis (the table and ratios of the
benchmarks are tested in tests/benchmarks/test_harness.py).
The last test checks that the worker refuses to run with this project's `kfac_jax`.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from benchmarks.upstream import compare  # noqa: E402


def test_flatten_unflatten_roundtrip():
  tree = {
    "params": {
      "dense_0": {"kernel": np.arange(6.0).reshape(2, 3), "bias": np.ones(3)},
      "dense_1": {"kernel": np.zeros((3, 1))},
    }
  }
  flat = compare.flatten_params(tree)
  assert sorted(flat) == [
    "param:params/dense_0/bias",
    "param:params/dense_0/kernel",
    "param:params/dense_1/kernel",
  ]
  back = compare.unflatten_params({**flat, "images": np.zeros(2)})  # non-param keys ignored
  assert back.keys() == {"params"}
  assert back["params"].keys() == {"dense_0", "dense_1"}
  np.testing.assert_array_equal(
    back["params"]["dense_0"]["kernel"], tree["params"]["dense_0"]["kernel"]
  )
  np.testing.assert_array_equal(back["params"]["dense_1"]["kernel"], np.zeros((3, 1)))


def test_flatten_rejects_separator_in_key():
  with pytest.raises(ValueError, match=r"'a/b'.*'params'"):
    compare.flatten_params({"params": {"a/b": np.zeros(1)}})


def test_summarize_excludes_warmup():
  s = compare.summarize("x", [9.0, 0.1, 0.3, 0.2], [5.0, 4.0, 3.0, 2.0], warmup=1, extra=7)
  assert s["median_step_ms"] == pytest.approx(200.0)
  assert s["mean_step_ms"] == pytest.approx(200.0)
  assert s["min_step_ms"] == pytest.approx(100.0)
  assert (s["timed_steps"], s["loss_steps"], s["last_minibatch_loss"]) == (3, 4, 2.0)
  assert s["finite"] and s["extra"] == 7
  assert not compare.summarize("x", [1.0, 1.0], [1.0, float("nan")], warmup=0)["finite"]
  with pytest.raises(ValueError, match="warmup=2 leaves no timed step out of 2"):
    compare.summarize("x", [1.0, 1.0], [1.0, 1.0], warmup=2)


def test_smoothed_is_trailing_mean():
  x = np.array([5.0, 1.0, 3.0, 10.0, 2.0, 4.0])
  for w in (1, 2, 3, 10):
    want = [np.mean(x[max(0, t - w + 1) : t + 1]) for t in range(len(x))]
    np.testing.assert_allclose(compare.smoothed(x, w), want)
  with pytest.raises(ValueError, match="window must be >= 1, got 0"):
    compare.smoothed(x, 0)


def test_time_to_reach():
  losses = [10.0, 8.0, 6.0, 7.0, 3.0]
  times = [0.5, 1.0, 2.0, 4.0, 8.0]
  # Unsmoothed: the loss first drops to <= 6 at step 2, available after 0.5 + 1.0 seconds.
  assert compare.time_to_reach(losses, times, 6.0, window=1) == (2, pytest.approx(1.5))
  # Trailing mean of 2: 9, 7, 7, 6.5, 5 -> first <= 6 at step 4, after 7.5 seconds.
  assert compare.time_to_reach(losses, times, 6.0, window=2) == (4, pytest.approx(7.5))
  assert compare.time_to_reach(losses, times, 10.0, window=1) == (0, 0.0)
  assert compare.time_to_reach(losses, times, 2.9, window=1) is None


def test_curve_times_replaces_first_step_by_same_phase_median():
  t = [30.0, 1.0, 1.0, 5.0, 1.0, 1.0, 7.0, 1.0, 1.0, 6.0]
  out = compare.curve_times(t, period=3)  # inverse steps 3, 6, 9: median 6
  np.testing.assert_allclose(out, [6.0] + t[1:])
  assert t[0] == 30.0  # input untouched
  np.testing.assert_allclose(compare.curve_times([30.0, 1.0, 2.0], period=5), [1.5, 1.0, 2.0])
  np.testing.assert_allclose(compare.curve_times([30.0], period=5), [30.0])


@pytest.mark.slow
def test_worker_refuses_this_projects_kfac_jax(tmp_path):
  env = dict(os.environ, PYTHONPATH=_ROOT)
  proc = subprocess.run(
    [sys.executable, compare.WORKER, "in.npz", "cfg.json", str(tmp_path)],
    cwd=_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert proc.returncode != 0
  assert "needs DeepMind's kfac-jax" in proc.stderr, proc.stderr
  assert not (tmp_path / "result.json").exists()

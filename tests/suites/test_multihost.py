"""Several processes: 2 processes x 2 CPU devices on localhost (`jax.distributed`, gloo) train
equal to one process with 4 devices, and their state is checkpointed with orbax."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from tests import _multihost_worker as worker

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 2
TIMEOUT = 240  # Seconds for the whole run; a process left waiting on a dead peer ends here.


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _child_env() -> dict[str, str]:
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
  return dict(
    os.environ,
    XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=2".strip(),
    JAX_PLATFORMS="cpu",
    PYTHONPATH=path,
  )


@pytest.mark.slow
def test_two_processes_train_equal_to_one_process(tmp_path, x64):
  port, env = _free_port(), _child_env()
  procs, logs = [], []
  try:
    for i in range(PROCESSES):
      logs.append(open(tmp_path / f"log_{i}.txt", "w"))
      procs.append(
        subprocess.Popen(
          [sys.executable, str(ROOT / "tests" / "_multihost_worker.py")]
          + [str(port), str(i), str(PROCESSES), str(tmp_path)],
          env=env,
          cwd=tmp_path,
          stdout=logs[-1],
          stderr=subprocess.STDOUT,
        )
      )
    deadline = time.monotonic() + TIMEOUT
    # Meanwhile, the same steps in this process on a mesh of as many devices.
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    want, _ = worker.train(mesh)
    for p in procs:
      p.wait(timeout=max(1.0, deadline - time.monotonic()))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=30)
    for f in logs:
      f.close()
  for i, p in enumerate(procs):
    log = (tmp_path / f"log_{i}.txt").read_text()
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-4000:]}"

  want_flat = {
    jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(want)
  }
  for i in range(PROCESSES):
    got = np.load(tmp_path / f"params_{i}.npz")
    assert sorted(got.files) == sorted(want_flat)
    for name, value in want_flat.items():
      np.testing.assert_allclose(got[name], value, rtol=1e-8, atol=1e-10, err_msg=f"{i} {name}")
    report = json.loads((tmp_path / f"checkpoint_{i}.json").read_text())
    # The split inverses cannot be written whole by one process: the error says to use orbax,
    # and orbax restores every shard.
    assert report["state_to_bytes"].startswith("ValueError: state_to_bytes: "), report
    assert "split over devices of other processes" in report["state_to_bytes"]
    assert "orbax-checkpoint" in report["state_to_bytes"]
    assert report["orbax_round_trip"] is True

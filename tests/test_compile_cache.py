"""JAX's persistent compilation cache holds every front's step: a second process finds them.

Two launches of one script with one cache directory: the first compiles each front's training
step (and writes it to the cache), the second must read every one back instead of compiling
it. JAX writes no cache entry for a program that holds a host callback (`jax.debug.callback`,
`jax.pure_callback`, ...), so the steps hold none unless `Config(step_warnings=True)`.
"""

import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, optax
import kfac_jax

jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))

k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
params = {"w1": 0.3 * jax.random.normal(k1, (6, 8)), "w2": 0.3 * jax.random.normal(k2, (8, 3))}
batch = {"x": jax.random.normal(k3, (16, 6)), "y": jnp.arange(16) % 3}

def loss_fn(p, b):
  logits = jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]
  kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

reg = kfac_jax.Registration(loss_fn, params, batch)
vg = kfac_jax.value_and_grad(registration=reg)

def transform_step(tx):
  def step(p, s, b, r):
    loss, g, stats = vg(p, b, r)
    u, s = tx.update(g, s, p, curvature_stats=stats)
    return optax.apply_updates(p, u), s, loss
  return step, tx.init(params)

opt = kfac_jax.Optimizer(registration=reg)
steps = {
  "scale_by_kfac": transform_step(
    optax.chain(kfac_jax.scale_by_kfac(registration=reg), optax.scale_by_learning_rate(0.1))
  ),
  "kfac": transform_step(kfac_jax.kfac(registration=reg, learning_rate=0.1)),
  "Optimizer": (lambda p, s, b, r: opt.step(p, s, b, r), opt.init(params)),
}
kernel = kfac_jax.kernel_ngd(loss_fn, batch, learning_rate=0.1)

def kernel_step(p, s, b, r):
  loss, g = jax.value_and_grad(loss_fn)(p, b)
  u, s = kernel.update(g, s, p, batch=b)
  return optax.apply_updates(p, u), s, loss

steps["kernel_ngd"] = (kernel_step, kernel.init(params))
hits = {}
for name, (step, state) in steps.items():
  jax.block_until_ready(state)
  events.clear()
  jax.jit(step).lower(params, state, batch, jax.random.key(1)).compile()
  hits[name] = events.count("/jax/compilation_cache/cache_hits")
print(json.dumps(hits))
"""


def _launch(script, cache) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_ROOT)
  out = subprocess.run(
    [sys.executable, str(script), str(cache)],
    env=env,
    cwd=_ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_reads_every_step_from_the_persistent_cache(tmp_path):
  script = tmp_path / "steps.py"
  script.write_text(_SCRIPT)
  cache = tmp_path / "cache"
  first = _launch(script, cache)
  fronts = ("scale_by_kfac", "kfac", "Optimizer", "kernel_ngd")
  assert first == dict.fromkeys(fronts, 0), first  # An empty cache.
  second = _launch(script, cache)
  assert second == dict.fromkeys(fronts, 1), second

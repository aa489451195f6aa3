"""`compile_step`: a training step compiled ahead of time, saying so where a user waits."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax

_HIT = "/jax/compilation_cache/cache_hits"
_WRITTEN = "/jax/compilation_cache/cache_misses"  # A miss JAX then writes to the cache.


def compile_step(
  step: Callable,
  *args,
  name: str = "the training step",
  donate_argnums: int | Sequence[int] = (),
  log: Callable[[str], None] | None = print,
):
  """`jax.jit(step)` compiled for `args` now, not at its first call, telling `log` what it waits
  for and whether JAX's persistent compilation cache held it.

  Args:
    step: the training step, e.g. `lambda params, state, batch, rng: ...`.
    *args: example arguments of the call's shapes, dtypes and shardings (the first batch).
    name: how the messages name the step.
    donate_argnums: as in `jax.jit` (the params and state a loop replaces).
    log: called with a line before and a line after; None for silence.

  Returns:
    The compiled step (`jax.stages.Compiled`), called with arguments like `args`.

  Example:
    >>> def step(params, opt_state, batch, rng):
    ...   loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    ...   updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    ...   return optax.apply_updates(params, updates), opt_state, loss
    >>> train = kfac_jax.compile_step(step, params, opt_state, batch, rng, name="K-FAC step")
    compiling K-FAC step...
    compiled K-FAC step in ... s (...).
    >>> params, opt_state, loss = train(params, opt_state, batch, rng)
  """
  say = log or (lambda _: None)
  events: list[str] = []
  say(f"compiling {name}...")
  start = time.perf_counter()
  listener = lambda event, **_: events.append(event)  # noqa: E731
  jax.monitoring.register_event_listener(listener)
  try:
    lowered = jax.jit(step, donate_argnums=donate_argnums).lower(*args)
    compiled = lowered.compile()
  finally:
    jax.monitoring.unregister_event_listener(listener)
  seconds = time.perf_counter() - start
  if _HIT in events:
    where = "read from JAX's persistent compilation cache"
  elif _WRITTEN in events:
    where = "written to JAX's persistent compilation cache for the next launch"
  elif not jax.config.jax_compilation_cache_dir:  # type: ignore[attr-defined]
    where = (
      "the next launch compiles it again unless JAX's persistent compilation cache is on: "
      "jax.config.update('jax_compilation_cache_dir', DIR)"
    )
  elif "callback" in lowered.as_text():
    where = "not cacheable: it holds a host callback (`Config(step_warnings=True)`?)"
  else:
    where = "compiled before in this process"
  say(f"compiled {name} in {seconds:.1f} s ({where}).")
  return compiled

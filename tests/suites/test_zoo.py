"""Model zoo, each in Flax linen and nnx: the scanner finds every layer, one K-FAC step descends.

For each model (tests/_zoo.py): the registration finds exactly the expected kinds,
approximations and parameter paths and `summary` lists them (no generic fallback); one jitted
step (value_and_grad with curvature statistics, then `scale_by_kfac`) runs and gives finite
updates u = (F̂ + λ)⁻¹ g; the step −u is a descent direction, ⟨−u, g⟩ < 0, and a small step along
it lowers the loss. Each model is scanned once: one `Registration` serves every front.
Every registration is built eagerly with `strict=True`, so the loss audit (kfac_jax/_audit.py)
measures each model's tags against its loss on the batch; no model opts out with
`check_loss=False` (sums and means over tokens, elements and the batch differ by a constant).
Scan and compile times are recorded by benchmarks/zoo.py, not here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _zoo


def _vdot(a, b):
  return sum(
    jnp.vdot(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
  )


def _registered(z):
  """`z`'s registration, built eagerly with `strict=True` (so the loss audit measures the tags
  against the loss on the batch; a mismatch is an error), after checking that the scanner
  found exactly the expected layers and that `summary` lists them with no generic fallback.
  Every front below shares it, so the model is scanned once."""
  reg = kfac_jax.Registration(z.loss_fn, z.params, z.batch, strict=True, has_aux=z.has_aux)
  specs = reg.layers
  assert [(s.kind, s.approx, s.param_paths) for s in specs] == z.expected
  if z.check is not None:
    z.check(specs)
  table = kfac_jax.summary(registration=reg)
  assert "generic" not in table and "x the parameters'" in table
  for s in specs:
    assert s.name in table
  return reg


def _preconditioned(gu, gg, uu):
  """The cosine of a step direction u with the gradient g, from ⟨g, u⟩, ⟨g, g⟩ and ⟨u, u⟩: in
  (0, 0.999), a descent direction that is not a multiple of the gradient (K-FAC, not the
  identity)."""
  cos = float(gu) / np.sqrt(float(gg) * float(uu))
  assert 0 < cos < 0.999, cos


def _all_finite(tree):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
@pytest.mark.parametrize("name", sorted(set(_zoo.MODELS) - set(_zoo.STACKED_MODELS)))
def test_zoo_model(name, flavour):
  z = _zoo.MODELS[name](flavour)
  reg = _registered(z)
  tx = kfac_jax.scale_by_kfac(registration=reg, damping=1e-3)

  @jax.jit
  def step(params, batch, rng):
    """init, one step, and the checks' reductions, in one program (eager ops compile one by
    one): the loss after a small step along −u, of norm 1e-3 ‖params‖."""
    state = tx.init(params)
    loss, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    uu = _vdot(updates, updates)
    scale = 1e-3 * jnp.sqrt(_vdot(params, params) / uu)
    moved = jax.tree_util.tree_map(lambda p, d: p - scale * d, params, updates)
    checks = {
      "finite": _all_finite(updates),
      "gu": _vdot(grads, updates),
      "gg": _vdot(grads, grads),
      "uu": uu,
      "moved_loss": z.loss_fn(moved, batch),
    }
    return loss, grads, updates, state, checks

  loss, grads, updates, state, checks = step(z.params, z.batch, jax.random.key(0))
  assert bool(checks["finite"]), "updates not finite"
  assert int(state.count) == 1
  _preconditioned(checks["gu"], checks["gg"], checks["uu"])
  # A small step along −u lowers the loss.
  assert float(checks["moved_loss"]) < float(loss), (checks["moved_loss"], loss)
  assert len(jax.tree_util.tree_leaves(grads)) == len(jax.tree_util.tree_leaves(updates))


def _nbytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def _ten_jitted_steps(z, tx, state, reg):
  """10 jitted steps; asserts the losses and params stay finite and the loss decreases. With
  `z.has_aux`, the model state returned as the aux is fed back as `batch["state"]`. The step
  keys are "rbg" keys (`_zoo._key`), cheap to compile. Returns the params after the first step
  and the gradient at `z.params`."""

  step = _zoo.train_step(z, tx, reg, with_grads=True)

  params, batch, losses = z.params, z.batch, []
  for i in range(11):  # The 11th step's loss is the loss after 10 (no second compile).
    params, state, batch, loss, grads = step(params, state, batch, _zoo._key(i))
    losses.append(float(loss))
    if i == 0:
      first, first_grads = params, grads
  assert all(np.isfinite(losses)), losses
  assert all(np.all(np.isfinite(p)) for p in jax.tree_util.tree_leaves(params))
  assert losses[-1] < losses[0], losses
  return first, first_grads


# The structure models whose 10 training steps run: one per pattern family, the four styles
# (linen, nnx, Haiku, equinox) spread over them. Each family's other members differ from its
# trained one in what the scanner must find (checked for every model), not in the blocks or
# statistics a step computes. Families: plain conv nets (haiku_cnn, equinox_cnn; the MLPs
# have only dense layers), Gemma's `1 + scale` norm, positional and shift-only tables
# (vit_nnx's class token, equinox_vit's vmapped table, the T5 relative bias gathered with
# repeats; vit_positional, haiku_vit, vit_linen, gpt2_positions_linen, map_head_linen not
# trained), recurrences in a scan (lstm_rnn, gru_nnx, equinox_gru; lstm, lstm_nnx,
# lstm_cell_nnx, gru_linen, haiku_lstm not trained), a VAE (vae; vae_nnx, equinox_vae not
# trained), BatchNorm state fed back (equinox_resnet, ensemble_batchnorm_linen's stacked scales;
# haiku_resnet not trained), MoE (moe; moe_nnx, haiku_moe not trained), a stacked LM in another
# style than test_stacked_zoo_model_trains' (haiku_lm; equinox_lm not trained), locally
# connected layers, and the architectures with a statistics path of their own: per-step labels
# over dilated convolutions (tcn_linen), a squared-error loss (dit_nnx), LayerNorms over graph
# rows (graphnet_linen) and attention over merged batch axes (timesformer_linen; perceiver_linen,
# mixer_nnx, gnn_haiku, gpt2_linen and equinox_unet not trained), and PINNs (pinn_poisson's
# forward Laplacian; pinn_hessian's per-point operator, whose hoisted taps and transposed uses
# are their own statistics path; pinn_vmap_jvp, pinn_grad_grad and pinn_heat not trained).
# vocab_lm is checked by its state's bytes, not trained.
TRAINED = {
  "haiku_cnn",
  "equinox_cnn",
  "gemma_rmsnorm",
  "vit_nnx",
  "equinox_vit",
  "t5_relative_bias_linen",
  "lstm_rnn",
  "gru_nnx",
  "equinox_gru",
  "vae",
  "equinox_resnet",
  "ensemble_batchnorm_linen",
  "moe",
  "haiku_lm",
  "locally_connected",
  "tcn_linen",
  "dit_nnx",
  "graphnet_linen",
  "timesformer_linen",
  "pinn_poisson",
  "pinn_hessian",
}
assert TRAINED <= set(_zoo.STRUCTURE_MODELS), TRAINED - set(_zoo.STRUCTURE_MODELS)


@pytest.mark.parametrize("name", sorted(_zoo.STRUCTURE_MODELS))
def test_structure_zoo_model(name):
  """Haiku, equinox, Gemma RMSNorm, positional table, OptimizedLSTMCell, 32k head, VAE,
  BatchNorm ResNets (Haiku, equinox), top-k MoE, equinox GRU; ViT (linen; nnx with a class
  token), nnx LSTMs (`nnx.RNN`), GRUs (linen, nnx), nnx MoE and VAE; and Haiku / equinox
  versions of the scanned decoder LM, ViT, LSTM, MoE and VAE (`_zoo.HX_MODELS`); a dilated
  causal TCN, a DiT block with adaLN-Zero, a Perceiver (learned latents), an MLP-Mixer, a
  message-passing graph network (Haiku), GPT-2 and a TimeSformer (divided space-time attention
  over merged batch axes), an equinox U-Net with GroupNorms, a jraph-style GraphNet with
  LayerNorms over node and edge rows, a BatchNorm'd ensemble under `nn.vmap` (stacked scales
  and shifts), a MAP head (a tiled probe and its query projection), a T5 layer
  (relative-position bias) and GPT-2 embeddings with position ids built inside: every layer
  found with `strict=True`, the loss tags fit the loss (the audit, measured on the batch), the
  state's bytes reported by `summary` (and bounded for the vocabulary head), and for the
  `TRAINED` models 10 jitted K-FAC steps finite with the loss decreasing."""
  pytest.importorskip("haiku")
  pytest.importorskip("equinox")
  z = _zoo.STRUCTURE_MODELS[name]()
  reg = _registered(z)
  tx = optax.chain(
    kfac_jax.scale_by_kfac(registration=reg, damping=z.damping, inverse_every=1),
    optax.scale(-0.05),
  )
  state_bytes = _nbytes(jax.eval_shape(tx.init, z.params))
  print(f"{name}: state {state_bytes} B, params {_nbytes(z.params)} B")
  if name == "vocab_lm":
    assert state_bytes < 3 * _nbytes(z.params)
  if name in TRAINED:
    _ten_jitted_steps(
      z, tx, jax.jit(tx.init)(z.params), reg
    )  # Jitted: eager ops compile one by one.


# -- stacked / rematerialised models ------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
@pytest.mark.parametrize("name", sorted(_zoo.STACKED_MODELS))
def test_stacked_zoo_model_trains(name, flavour):
  """Scan-over-layers (and remat) models: the layers found as expected (as `test_zoo_model`
  checks the others), the stacked leaves are stacked blocks, never generic; the first step is
  preconditioned and 10 jitted K-FAC steps stay finite and lower the loss."""
  z = _zoo.MODELS[name](flavour)
  reg = _registered(z)
  stacked = [s for s in reg.layers if s.stack_size]
  assert stacked and all(s.stack_size == _zoo.LM_LAYERS for s in stacked)
  assert all(f[0] == _zoo.LM_LAYERS for s in stacked for f in s.factor_shapes)
  tx = optax.chain(
    kfac_jax.scale_by_kfac(registration=reg, damping=1e-2, inverse_every=1),
    optax.scale_by_learning_rate(0.1),
  )
  first, grads = _ten_jitted_steps(z, tx, jax.jit(tx.init)(z.params), reg)
  grads = [np.asarray(g, np.float64) for g in jax.tree_util.tree_leaves(grads)]
  d = [
    np.asarray(p, np.float64) - np.asarray(q, np.float64)
    for p, q in zip(jax.tree_util.tree_leaves(z.params), jax.tree_util.tree_leaves(first))
  ]
  dot = lambda a, b: sum(float(np.vdot(x, y)) for x, y in zip(a, b))  # noqa: E731
  _preconditioned(dot(grads, d), dot(grads, grads), dot(d, d))

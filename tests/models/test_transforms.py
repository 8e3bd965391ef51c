"""JAX's transforms on every family's tiny preset, with the defaults (plain kernels, `dense`).

Each transform's result is checked against the same quantity computed another way:
forward mode against reverse mode, forward-over-reverse against reverse-over-reverse, per-
example gradients against one gradient per example, remat against no remat.
"""

import functools
import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax import models

PRESETS = {
    "gpt": ("gpt", "tiny"),
    "llama": ("gpt", "llama-tiny"),
    "bert": ("bert", "tiny"),
    "t5": ("t5", "tiny"),
    "transformer": ("transformer", "tiny"),
}
B, T = 2, 8


@functools.lru_cache(maxsize=None)
def _setup(name: str, kernels: str = "plain"):
  """(loss(params, batch) summed over examples, params, batch) for a preset's model."""
  module_name, preset = PRESETS[name]
  config = importlib.import_module(f"configs.{module_name}").get_config(preset)
  config.model.kernels = kernels
  assert config.model.attention_backend == "dense"
  module = models.build(config.model)
  rng = np.random.default_rng(0)
  vocab = config.model.vocab_size
  ids = lambda: jnp.asarray(rng.integers(1, vocab, (B, T)), jnp.int32)  # noqa: E731
  if config.model.family == "encdec":
    batch = {"encoder_inputs": ids(), "decoder_inputs": ids()}
  else:
    batch = {"inputs": ids()}
  args, kwargs = models.model_inputs(config.model, batch)
  params = nn.unbox(module.init(jax.random.PRNGKey(0), *args, **kwargs)["params"])

  def loss(params, batch):
    args, kwargs = models.model_inputs(config.model, batch)
    out = module.apply({"params": params}, *args, **kwargs)
    logits = out[0] if isinstance(out, tuple) else out  # BERT without a head: (x, pooled)
    # A fixed random readout, so every output and parameter matters.
    readout = jax.random.normal(jax.random.PRNGKey(1), logits.shape[1:], logits.dtype)
    return jnp.sum(jnp.tanh(logits) * readout)

  return loss, params, batch


def _tangent(params, seed):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return treedef.unflatten(
      [jax.random.normal(k, x.shape, x.dtype) * 0.1 for k, x in zip(keys, leaves)]
  )


def _vdot(a, b):
  return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _assert_trees_close(a, b, rtol, atol, relative_atol=0.0):
  """allclose leaf by leaf; relative_atol adds that fraction of the leaf's largest value to
  atol, for float32 sums whose rounding grows with their largest terms."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    y = np.asarray(y)
    tolerance = atol + relative_atol * float(np.max(np.abs(y), initial=0.0))
    np.testing.assert_allclose(np.asarray(x), y, rtol=rtol, atol=tolerance)


@pytest.mark.parametrize("name", list(PRESETS))
def test_jvp_and_linearize_equal_the_gradient_along_the_tangent(name):
  loss, params, batch = _setup(name)
  f = jax.jit(lambda p: loss(p, batch))
  tangent = _tangent(params, 2)
  value, directional = jax.jit(lambda p, t: jax.jvp(f, (p,), (t,)))(params, tangent)
  from_grad = _vdot(jax.jit(jax.grad(f))(params), tangent)
  np.testing.assert_allclose(value, f(params), rtol=1e-5)
  np.testing.assert_allclose(directional, from_grad, rtol=2e-4, atol=1e-4)
  _, f_jvp = jax.linearize(f, params)
  np.testing.assert_allclose(f_jvp(tangent), directional, rtol=2e-4, atol=1e-4)
  # A central difference, in float32: a loose but independent check of the scale.
  eps = 1e-3
  step = lambda s: jax.tree.map(lambda p, t: p + s * eps * t, params, tangent)  # noqa: E731
  difference = (f(step(1.0)) - f(step(-1.0))) / (2 * eps)
  np.testing.assert_allclose(directional, difference, rtol=2e-2, atol=1.0)


@pytest.mark.parametrize("name", list(PRESETS))
def test_forward_over_reverse_hvp_equals_reverse_over_reverse(name):
  loss, params, batch = _setup(name)
  f = lambda p: loss(p, batch)  # noqa: E731
  tangent, probe = _tangent(params, 3), _tangent(params, 4)
  hvp = jax.jit(lambda p, t: jax.jvp(jax.grad(f), (p,), (t,))[1])(params, tangent)
  reverse = jax.jit(jax.grad(lambda p: _vdot(jax.grad(f)(p), tangent)))(params)
  _assert_trees_close(hvp, reverse, rtol=2e-3, atol=1e-4, relative_atol=1e-5)
  assert float(jnp.abs(_vdot(hvp, probe))) > 0  # the Hessian is not trivially zero


@pytest.mark.parametrize("name", list(PRESETS))
def test_per_example_gradients_by_vmap_equal_one_gradient_per_example(name):
  loss, params, batch = _setup(name)
  one = lambda p, example: loss(p, jax.tree.map(lambda x: x[None], example))  # noqa: E731
  per_example = jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0)))(params, batch)
  grad_one = jax.jit(jax.grad(one))
  for i in range(B):
    alone = grad_one(params, jax.tree.map(lambda x: x[i], batch))
    _assert_trees_close(
        jax.tree.map(lambda g: g[i], per_example), alone, rtol=1e-4, atol=1e-6, relative_atol=3e-5
    )
  summed = jax.tree.map(lambda g: g.sum(0), per_example)
  _assert_trees_close(
      summed, jax.jit(jax.grad(loss))(params, batch), rtol=1e-4, atol=1e-5, relative_atol=3e-5
  )


@pytest.mark.parametrize("name", list(PRESETS))
def test_checkpointed_gradient_equals_the_plain_gradient(name):
  loss, params, batch = _setup(name)
  plain = jax.jit(jax.grad(loss))(params, batch)
  remat = jax.jit(jax.grad(jax.checkpoint(loss)))(params, batch)
  _assert_trees_close(remat, plain, rtol=1e-5, atol=1e-6)


def test_cpu_kernels_are_reverse_mode_only_and_agree_with_plain():
  """The opt-in CPU kernels refuse forward mode (as their docs say) and give plain's values."""
  loss_cpu, params, batch = _setup("gpt", "cpu")
  loss_plain, _, _ = _setup("gpt")
  np.testing.assert_allclose(loss_cpu(params, batch), loss_plain(params, batch), rtol=1e-5)
  _assert_trees_close(
      jax.grad(loss_cpu)(params, batch), jax.grad(loss_plain)(params, batch), 1e-4, 5e-5
  )
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda p: loss_cpu(p, batch), (params,), (_tangent(params, 2),))

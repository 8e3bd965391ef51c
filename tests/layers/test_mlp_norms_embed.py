"""Linear, MLPs, norms, embeddings and axis names against numpy formulas and flax references."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.layers import axes, ops
from tx_jax.layers.embed import Embed
from tx_jax.layers.linear import Linear
from tx_jax.layers.mlp import GatedMlp, Mlp
from tx_jax.layers.norms import NormSpec, make_norm

X = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
ERF = np.vectorize(math.erf)
NUMPY_ACT = {
    "relu": lambda x: np.maximum(x, 0),
    "gelu": lambda x: 0.5 * x * (1 + ERF(x / np.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
    "silu": lambda x: x / (1 + np.exp(-x)),
}


def _init(module, *args):
  return nn.unbox(module.init(jax.random.PRNGKey(0), *args)["params"])


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_mlp(activation):
  module = Mlp(hidden=16, activation=activation)
  p = _init(module, X)
  x = X.astype(np.float64)
  h = NUMPY_ACT[activation](x @ np.asarray(p["wi"]["kernel"]) + np.asarray(p["wi"]["bias"]))
  expected = h @ np.asarray(p["wo"]["kernel"]) + np.asarray(p["wo"]["bias"])
  np.testing.assert_allclose(np.asarray(module.apply({"params": p}, X)), expected, atol=1e-5)


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])  # GeGLU (T5 v1.1), SwiGLU (LLaMA)
def test_gated_mlp(activation):
  module = GatedMlp(hidden=16, activation=activation)
  p = _init(module, X)
  x = X.astype(np.float64)
  h = NUMPY_ACT[activation](x @ np.asarray(p["wi_0"]["kernel"])) * (
      x @ np.asarray(p["wi_1"]["kernel"])
  )
  expected = h @ np.asarray(p["wo"]["kernel"])
  np.testing.assert_allclose(np.asarray(module.apply({"params": p}, X)), expected, atol=1e-5)


@pytest.mark.parametrize("use_bias", [True, False])
def test_layernorm(use_bias):
  module = make_norm(NormSpec("layernorm", eps=1e-5, use_bias=use_bias))
  p = _init(module, X)
  p = jax.tree.map(lambda a: a + 0.3, p)  # non-trivial scale / bias
  x = X.astype(np.float64)
  normed = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
  expected = normed * np.asarray(p["scale"]) + (np.asarray(p["bias"]) if use_bias else 0)
  assert ("bias" in p) == use_bias
  np.testing.assert_allclose(np.asarray(module.apply({"params": p}, X)), expected, atol=1e-5)


def test_rmsnorm():
  module = make_norm(NormSpec("rmsnorm", eps=1e-6))
  p = jax.tree.map(lambda a: a * 1.7, _init(module, X))
  x = X.astype(np.float64)
  expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(p["scale"])
  assert set(p) == {"scale"}
  np.testing.assert_allclose(np.asarray(module.apply({"params": p}, X)), expected, atol=1e-5)


def _flax_norm(kind: str, use_bias: bool) -> nn.Module:
  """flax's own module for the same norm: the reference for params, forward and gradients."""
  if kind == "rmsnorm":
    return nn.RMSNorm(epsilon=1e-5, dtype=jnp.float32)
  return nn.LayerNorm(epsilon=1e-5, use_bias=use_bias, dtype=jnp.float32)


@pytest.mark.parametrize("kernels", ["plain", "cpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind,use_bias", [("layernorm", True), ("layernorm", False), ("rmsnorm", False)])
def test_norm_is_flax_bit_for_bit_and_its_backward_is_flax_autodiff(kind, use_bias, dtype, kernels):
  """Under each kernel set (plain: autodiff; cpu: a hand-written VJP) against autodiff of
  flax's module, on params that are not the initial ones and inputs with a large mean (the
  fast variance's worst case)."""
  ours = make_norm(NormSpec(kind, eps=1e-5, use_bias=use_bias, kernels=kernels))
  reference = _flax_norm(kind, use_bias)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((3, 5, 24)) * 2 + 3, dtype)
  params = _init(ours, x)
  assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, _init(reference, x))
  params = jax.tree.map(lambda a: a + jnp.asarray(rng.standard_normal(a.shape) * 0.3, a.dtype), params)
  out = jax.jit(ours.apply)({"params": params}, x)
  expected = jax.jit(reference.apply)({"params": params}, x)
  assert out.dtype == expected.dtype
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))

  cotangent = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)

  def grads(module):
    loss = lambda p, x: jnp.sum(module.apply({"params": p}, x).astype(jnp.float32) * cotangent)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

  (got_params, got_x), (want_params, want_x) = grads(ours), grads(reference)
  assert got_x.dtype == x.dtype and jax.tree.map(jnp.dtype, got_params) == jax.tree.map(jnp.dtype, params)
  # bf16 inputs: dx rounds to bf16 after float32 math in a different order, ~1 ulp apart.
  rtol = 1e-5 if dtype == jnp.float32 else 1e-2
  for got, want in zip(jax.tree.leaves((got_params, got_x)), jax.tree.leaves((want_params, want_x))):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def test_unknown_norm_names_the_field():
  with pytest.raises(ValueError, match="model.norm='batchnorm'"):
    make_norm(NormSpec("batchnorm", eps=1e-5))


def test_embed_attend_is_the_transposed_table():
  module = Embed(11, 8)
  ids = jnp.array([[0, 5, 10]])
  p = _init(module, ids)
  table = np.asarray(p["embedding"])
  np.testing.assert_array_equal(np.asarray(module.apply({"params": p}, ids))[0], table[[0, 5, 10]])
  logits = module.apply({"params": p}, jnp.asarray(X), method=Embed.attend)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logits), X @ table.T, atol=1e-5)


def test_linear_contracts_trailing_dims_with_a_boxed_full_rank_kernel():
  x = X.reshape(2, 3, 2, 4)  # contract the last two dims [2, 4] -> features (3, 5)
  module = Linear((3, 5), ("heads", "head_dim", "embed", "mlp"), in_dims=2, use_bias=True)
  boxed = module.init(jax.random.PRNGKey(0), x)["params"]
  assert boxed["kernel"].names == ("heads", "head_dim", "embed", "mlp")
  assert boxed["bias"].names == ("embed", "mlp")
  p = jax.tree.map(lambda a: a + 0.1, nn.unbox(boxed))  # a non-zero bias
  kernel, bias = np.asarray(p["kernel"]), np.asarray(p["bias"])
  expected = np.einsum("btij,ijfg->btfg", x.astype(np.float64), kernel) + bias
  np.testing.assert_allclose(np.asarray(module.apply({"params": p}, x)), expected, atol=1e-5)


@pytest.mark.parametrize("use_bias", [True, False])
def test_linear_is_nn_dense_bit_for_bit(use_bias):
  """Same parameter names, init and output as flax's nn.Dense (checkpoints stay loadable)."""
  init = nn.initializers.normal(0.3)
  ours = Linear(6, ("embed", "vocab"), use_bias=use_bias, kernel_init=init)
  dense = nn.Dense(6, use_bias=use_bias, kernel_init=init)
  p_ours = nn.unbox(ours.init(jax.random.PRNGKey(1), X)["params"])
  p_dense = dense.init(jax.random.PRNGKey(1), X)["params"]
  assert jax.tree.structure(p_ours) == jax.tree.structure(p_dense)
  for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_dense)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(
      np.asarray(ours.apply({"params": p_ours}, X)), np.asarray(dense.apply({"params": p_dense}, X))
  )


@pytest.mark.parametrize(
    "x_shape, kernel_shape, in_dims",
    [
        ((2, 3, 4), (4, 16), 1),  # widening: the hand-written backward
        ((2, 3, 16), (16, 4), 1),  # narrowing: autodiff's
        ((2, 3, 2, 4), (2, 4, 3, 5), 2),  # widening over two contracted dims
        ((3, 4), (4, 4), 1),  # equal widths: the hand-written backward too
        ((2, 3, 2, 4), (2, 4, 8), 2),  # equal widths over two dims (attention's out)
    ],
)
@pytest.mark.parametrize("kernels", ["plain", "cpu"])
def test_project_gradients_equal_numpy(x_shape, kernel_shape, in_dims, kernels):
  """y = x·W; for a loss Σ y·c: dx = c·Wᵀ and dW = Σ_batch x ⊗ c, whichever backward runs."""
  project = ops.get(kernels).project
  rng = np.random.default_rng(1)
  x, kernel = rng.standard_normal(x_shape), rng.standard_normal(kernel_shape)
  cot = rng.standard_normal(x_shape[: len(x_shape) - in_dims] + kernel_shape[in_dims:])
  flat_in = int(np.prod(kernel_shape[:in_dims]))
  x2, k2 = x.reshape(-1, flat_in), kernel.reshape(flat_in, -1)
  c2 = cot.reshape(x2.shape[0], -1)
  loss = lambda x, w: jnp.sum(project(x, w, in_dims) * jnp.asarray(cot, jnp.float32))  # noqa: E731
  dx, dw = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x, jnp.float32), jnp.asarray(kernel, jnp.float32))
  np.testing.assert_allclose(np.asarray(dx), (c2 @ k2.T).reshape(x_shape), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), (x2.T @ c2).reshape(kernel_shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["plain", "cpu"])
def test_project_keeps_autodiffs_dtypes_with_a_float32_accumulator(kernels):
  """bf16 operands with float32 logits (the tied output embedding): each kernel set's
  backward returns what autodiff of the same dot_general returns, bit for bit."""
  project = ops.get(kernels).project
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.bfloat16)
  kernel = jnp.asarray(rng.standard_normal((4, 16)), jnp.bfloat16)
  cot = jnp.asarray(rng.standard_normal((2, 3, 16)), jnp.float32)
  ours = jax.vjp(lambda x, w: project(x, w, 1, preferred_element_type=jnp.float32), x, kernel)
  plain = jax.vjp(
      lambda x, w: jnp.einsum("btd,dv->btv", x, w, preferred_element_type=jnp.float32), x, kernel
  )
  assert ours[0].dtype == jnp.float32
  for a, b in zip(ours[1](cot), plain[1](cot)):
    assert a.dtype == b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_linear_rejects_axes_of_the_wrong_rank():
  with pytest.raises(ValueError, match=r"axes=\('embed',\) must name 1 input and 1 feature"):
    Linear(4, ("embed",)).init(jax.random.PRNGKey(0), X)


def test_axis_letters_name_activation_axes():
  assert axes.activation_axes("BTNH") == ("act_batch", "act_len", "act_heads", "act_head_dim")
  assert axes.activation_axes("BSKH")[1:3] == ("act_kv_len", "act_kv_heads")
  with pytest.raises(ValueError, match=r"'BTX': unknown letters \['X'\]"):
    axes.activation_axes("BTX")
  with pytest.raises(ValueError, match=r"'BT' names 2 dims, the array has 3"):
    axes.constrain(jnp.asarray(X), "BT")

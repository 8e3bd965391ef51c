"""MLPs, norms and embeddings against numpy formulas."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.layers.embed import Embed
from tx_jax.layers.mlp import GatedMlp, Mlp
from tx_jax.layers.norms import make_norm

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
  module = make_norm("layernorm", eps=1e-5, use_bias=use_bias)
  p = _init(module, X)
  p = jax.tree.map(lambda a: a + 0.3, p)  # non-trivial scale / bias
  x = X.astype(np.float64)
  normed = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
  expected = normed * np.asarray(p["scale"]) + (np.asarray(p["bias"]) if use_bias else 0)
  assert ("bias" in p) == use_bias
  np.testing.assert_allclose(np.asarray(module.apply({"params": p}, X)), expected, atol=1e-5)


def test_rmsnorm():
  module = make_norm("rmsnorm", eps=1e-6)
  p = jax.tree.map(lambda a: a * 1.7, _init(module, X))
  x = X.astype(np.float64)
  expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(p["scale"])
  assert set(p) == {"scale"}
  np.testing.assert_allclose(np.asarray(module.apply({"params": p}, X)), expected, atol=1e-5)


def test_unknown_norm_names_the_field():
  with pytest.raises(ValueError, match="model.norm='batchnorm'"):
    make_norm("batchnorm", eps=1e-5)


def test_embed_attend_is_the_transposed_table():
  module = Embed(11, 8)
  ids = jnp.array([[0, 5, 10]])
  p = _init(module, ids)
  table = np.asarray(p["embedding"])
  np.testing.assert_array_equal(np.asarray(module.apply({"params": p}, ids))[0], table[[0, 5, 10]])
  logits = module.apply({"params": p}, jnp.asarray(X), method=Embed.attend)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logits), X @ table.T, atol=1e-5)

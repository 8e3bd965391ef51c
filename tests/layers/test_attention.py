"""Attention against an independent numpy softmax(Q·Kᵀ/√d_k)·V, for every mask kind."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.layers import masks
from tx_jax.layers.attention import MultiHeadAttention
from tx_jax.layers.attention.dense import dense_attention
from tx_jax.layers.attention import AttentionSpec

B, T, D, N, H = 2, 6, 16, 4, 8


def numpy_attention(q, k, v, mask=None, bias=None):
  """Per head, in float64: softmax(q kᵀ / sqrt(H) + bias) v; masked keys weigh 0."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  groups = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  allowed = (
      np.ones(logits.shape, bool)
      if mask is None
      else np.broadcast_to(np.asarray(mask), logits.shape)
  )
  logits = np.where(allowed, logits, -np.inf)
  row_max = np.max(np.where(allowed, logits, -1e300), axis=-1, keepdims=True)
  weights = np.where(allowed, np.exp(logits - row_max), 0.0)
  denom = weights.sum(-1, keepdims=True)
  weights = np.divide(weights, denom, out=np.zeros_like(weights), where=denom > 0)
  return np.einsum("bnts,bsnh->btnh", weights, v), weights


def _qkv(num_kv_heads=N, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, T, num_kv_heads, H)).astype(np.float32)
  v = rng.standard_normal((B, T, num_kv_heads, H)).astype(np.float32)
  return q, k, v


def _mask_kinds():
  causal = masks.causal_mask_for_length(B, T)
  valid = jnp.array([[1] * T, [1] * 4 + [0] * (T - 4)], bool)
  padding = masks.padding_mask(valid, valid)
  segments = jnp.array([[1, 1, 1, 2, 2, 2], [1, 1, 2, 2, 2, 0]])
  packing = masks.segment_mask(segments, segments)
  return {
      "none": None,
      "causal": causal,
      "padding": padding,
      "packing": packing,
      "causal+packing": masks.combine(causal, packing),
  }


def _causal_packing_spec():
  segments = jnp.array([[1, 1, 1, 2, 2, 2], [1, 1, 2, 2, 2, 0]])
  return AttentionSpec.self_attention(segments, causal=True)


@pytest.mark.parametrize("kind", list(_mask_kinds()))
@pytest.mark.parametrize("num_kv_heads", [N, 2, 1])
def test_dense_matches_numpy(kind, num_kv_heads):
  q, k, v = _qkv(num_kv_heads)
  mask = _mask_kinds()[kind]
  out = dense_attention(q, k, v, mask, None, scale=H**-0.5)
  expected, _ = numpy_attention(q, k, v, mask)
  np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=2e-5)


def test_masked_keys_get_exactly_zero_weight():
  """Changing a masked key or value, even to a huge number, changes nothing bit for bit."""
  q, k, v = _qkv()
  mask = _mask_kinds()["causal"]
  out = dense_attention(q, k, v, mask, None, scale=H**-0.5)
  k2, v2 = k.copy(), v.copy()
  k2[:, -1], v2[:, -1] = 1e4, -1e4  # the last key is masked for every query but the last
  out2 = dense_attention(q, k2, v2, mask, None, scale=H**-0.5)
  np.testing.assert_array_equal(np.asarray(out)[:, :-1], np.asarray(out2)[:, :-1])


def test_fully_masked_rows_give_zeros_not_nan():
  q, k, v = _qkv()
  mask = jnp.zeros((B, 1, T, T), bool).at[0, :, :3].set(True)  # rows 3.. of batch 0, all of 1
  out = np.asarray(dense_attention(q, k, v, mask, None, scale=H**-0.5))
  assert np.isfinite(out).all()
  np.testing.assert_array_equal(out[0, 3:], 0.0)
  np.testing.assert_array_equal(out[1], 0.0)


def _module_and_params(num_kv_heads, use_bias=True):
  module = MultiHeadAttention(num_heads=N, num_kv_heads=num_kv_heads, head_dim=H, use_bias=use_bias)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, D)), jnp.float32)
  params = nn.unbox(module.init(jax.random.PRNGKey(0), x)["params"])
  return module, params, x


@pytest.mark.parametrize("num_kv_heads", [N, 2, 1])
def test_module_equals_numpy_projections(num_kv_heads):
  """Full layer (projections + attention + output) against numpy; K<N is GQA/MQA."""
  module, p, x = _module_and_params(num_kv_heads)
  spec = _causal_packing_spec()
  mask = spec.mask()
  out = module.apply({"params": p}, x, spec=spec)
  xn = np.asarray(x, np.float64)
  proj = lambda name: np.einsum("btd,dnh->btnh", xn, np.asarray(p[name]["kernel"])) + np.asarray(
      p[name]["bias"]
  )
  ctx, _ = numpy_attention(proj("query"), proj("key"), proj("value"), mask)
  expected = np.einsum("btnh,nhd->btd", ctx, np.asarray(p["out"]["kernel"])) + np.asarray(
      p["out"]["bias"]
  )
  np.testing.assert_allclose(np.asarray(out), expected, atol=3e-5, rtol=3e-5)


def test_gqa_with_all_kv_heads_equals_mha_with_repeated_heads():
  """GQA with K=2 equals MHA whose K/V projections repeat each KV head N/K times."""
  gqa, p, x = _module_and_params(2)
  mha = MultiHeadAttention(num_heads=N, num_kv_heads=N, head_dim=H, use_bias=True)
  p_mha = jax.tree.map(lambda a: a, p)
  for name in ("key", "value"):
    p_mha[name] = {
        "kernel": jnp.repeat(p[name]["kernel"], N // 2, axis=1),
        "bias": jnp.repeat(p[name]["bias"], N // 2, axis=0),
    }
  spec = AttentionSpec.self_attention(jnp.ones((B, T), jnp.int32), causal=True)
  np.testing.assert_allclose(
      np.asarray(gqa.apply({"params": p}, x, spec=spec)),
      np.asarray(mha.apply({"params": p_mha}, x, spec=spec)),
      atol=1e-5,
  )


def test_cross_attention_attends_to_memory():
  module = MultiHeadAttention(num_heads=N, num_kv_heads=N, head_dim=H)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  memory = jnp.asarray(rng.standard_normal((B, 9, D)), jnp.float32)
  p = nn.unbox(module.init(jax.random.PRNGKey(0), x, memory, is_cross=True)["params"])
  out = module.apply({"params": p}, x, memory, is_cross=True)
  xn, mn = np.asarray(x, np.float64), np.asarray(memory, np.float64)
  q = np.einsum("btd,dnh->btnh", xn, np.asarray(p["query"]["kernel"]))
  k = np.einsum("bsd,dnh->bsnh", mn, np.asarray(p["key"]["kernel"]))
  v = np.einsum("bsd,dnh->bsnh", mn, np.asarray(p["value"]["kernel"]))
  ctx, _ = numpy_attention(q, k, v)
  expected = np.einsum("btnh,nhd->btd", ctx, np.asarray(p["out"]["kernel"]))
  np.testing.assert_allclose(np.asarray(out), expected, atol=3e-5)


def test_attention_dropout_is_active_only_in_training():
  module = MultiHeadAttention(num_heads=N, num_kv_heads=N, head_dim=H, dropout_rate=0.5)
  _, p, x = _module_and_params(N, use_bias=False)
  eval_out = module.apply({"params": p}, x)
  np.testing.assert_array_equal(np.asarray(eval_out), np.asarray(module.apply({"params": p}, x)))
  train_a = module.apply({"params": p}, x, train=True, rngs={"dropout": jax.random.PRNGKey(1)})
  train_b = module.apply({"params": p}, x, train=True, rngs={"dropout": jax.random.PRNGKey(2)})
  assert not np.allclose(np.asarray(train_a), np.asarray(eval_out))
  assert not np.allclose(np.asarray(train_a), np.asarray(train_b))


def _fused(p, num_kv_heads):
  """The same weights as fused_qkv stores them: one "qkv" kernel [D, 3, N, H] (bias
  [3, N, H]) with as many kv heads as query heads, else "query" and "kv" [D, 2, K, H]."""
  stacked, names = (
      ("qkv", ("query", "key", "value")) if num_kv_heads == N else ("kv", ("key", "value"))
  )
  parts = [p.pop(name) for name in names]
  p[stacked] = {leaf: jnp.stack([q[leaf] for q in parts], axis=-3) for leaf in ("kernel", "bias")}
  return p


@pytest.mark.parametrize("num_kv_heads", [N, 2, 1])
def test_fused_qkv_equals_separate_projections_forward_and_backward(num_kv_heads):
  """Stacked kernels compute what the separate [D, N, H] / [D, K, H] ones do, gradients
  included; with fewer kv heads (GQA, MQA) only k and v share one."""
  module, p, x = _module_and_params(num_kv_heads)
  fused = MultiHeadAttention(
      num_heads=N, num_kv_heads=num_kv_heads, head_dim=H, use_bias=True, fused_qkv=True
  )
  p_fused = _fused(jax.tree.map(lambda a: a, p), num_kv_heads)
  initialized = nn.unbox(fused.init(jax.random.PRNGKey(1), x)["params"])
  assert jax.tree.map(jnp.shape, initialized) == jax.tree.map(jnp.shape, p_fused)
  spec = _causal_packing_spec()

  def loss(params, x, m):
    return jnp.sum(jnp.sin(m.apply({"params": params}, x, spec=spec)))

  (a, ga), (b, gb) = (
      jax.value_and_grad(loss, argnums=(0, 1))(params, x, m)
      for params, m in ((p, module), (p_fused, fused))
  )
  np.testing.assert_allclose(a, b, rtol=1e-6)
  close = dict(rtol=1e-5, atol=1e-6)  # float32: the wider GEMMs sum in another order
  np.testing.assert_allclose(np.asarray(ga[1]), np.asarray(gb[1]), **close)
  stacked_grads = _fused(dict(ga[0]), num_kv_heads)
  for name in stacked_grads:
    for leaf, grads in stacked_grads[name].items():
      np.testing.assert_allclose(np.asarray(grads), np.asarray(gb[0][name][leaf]), **close)


def test_fused_qkv_refuses_cross_attention():
  x = jnp.ones((B, T, D))
  module = MultiHeadAttention(num_heads=N, num_kv_heads=N, head_dim=H, fused_qkv=True)
  with pytest.raises(ValueError, match="cross-attention .*fused_qkv=False"):
    module.init(jax.random.PRNGKey(0), x, x, is_cross=True)


@pytest.mark.parametrize("name", ["lecun_normal", "xavier_uniform"])
def test_stacked_init_draws_each_projection_as_if_alone(name):
  """Fan-based inits see one projection's fan in each block of a stacked kernel."""
  from tx_jax.layers.linear import stacked_init  # pylint: disable=g-import-not-at-top

  init, d, width = getattr(nn.initializers, name)(), 256, 512
  stacked = np.asarray(stacked_init(init, 3)(jax.random.PRNGKey(0), (d, 3 * width)))
  alone = np.asarray(init(jax.random.PRNGKey(1), (d, width)))
  for block in np.split(stacked, 3, axis=1):
    assert abs(block.std() / alone.std() - 1) < 0.03
  # Drawn over the whole [d, 3 * width] kernel, xavier (fan_in + fan_out) would be narrower.
  whole = np.asarray(init(jax.random.PRNGKey(2), (d, 3 * width)))
  ratio = whole.std() / alone.std()
  assert ratio < 0.8 if name == "xavier_uniform" else abs(ratio - 1) < 0.03

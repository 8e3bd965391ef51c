"""An explicit mask through `AttentionSpec.explicit_mask`: a random pattern no other field
could express, per head, with rows that see no key, against the seed's formula in numpy
(softmax of masked_fill(mask == 0, -1e9), fully masked rows zeroed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.layers.attention import AttentionSpec, get_backend
from tx_jax.layers.attention.blockwise import blockwise_attention

B, T, N, K, H = 2, 9, 4, 2, 8
SCALE = 0.4


def _inputs(heads_in_mask):
  rng = np.random.default_rng(0)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, T, K, H)).astype(np.float32)
  v = rng.standard_normal((B, T, K, H)).astype(np.float32)
  mask = rng.random((B, heads_in_mask, T, T)) < 0.4
  mask[0, :, 3, :] = False  # a query that sees no key at all
  return q, k, v, mask


def _numpy_reference(q, k, v, mask):
  """The seed's attention, per query head (head n uses key/value head n // (N / K))."""
  groups = N // K
  k_n, v_n = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
  scores = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), k_n) * SCALE
  full_mask = np.broadcast_to(mask, scores.shape)
  scores = np.where(full_mask, scores, -1e9)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  weights = np.where(full_mask.any(-1, keepdims=True), weights, 0.0)
  return np.einsum("bnts,bsnh->btnh", weights, v_n)


def _spec(mask):
  return AttentionSpec.self_attention(
      jnp.ones((B, T), jnp.int32), causal=False, explicit_mask=jnp.asarray(mask)
  )


def _blockwise_small_blocks(q, k, v, spec, *, scale):
  return blockwise_attention(q, k, v, spec, scale=scale, block_q=4, block_k=3)


@pytest.mark.parametrize("heads_in_mask", [1, N])
@pytest.mark.parametrize("backend", ["dense", "blockwise"])
def test_explicit_mask_equals_the_seed_formula_in_numpy(backend, heads_in_mask):
  q, k, v, mask = _inputs(heads_in_mask)
  attend = _blockwise_small_blocks if backend == "blockwise" else get_backend(backend)
  out = jax.jit(attend, static_argnames="scale")(q, k, v, _spec(mask), scale=SCALE)
  want = _numpy_reference(q, k, v, mask)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(out)[0, 3], 0.0)


def test_explicit_mask_gradients_agree_between_dense_and_blockwise():
  q, k, v, mask = _inputs(N)
  spec = _spec(mask)
  w = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)

  def grads(attend):
    loss = lambda q, k, v: jnp.sum(attend(q, k, v, spec, scale=SCALE) * w)  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  for got, want in zip(grads(_blockwise_small_blocks), grads(get_backend("dense"))):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_explicit_mask_combines_with_causality():
  q, k, v, mask = _inputs(1)
  spec = _spec(mask).replace(causal=True)
  out = get_backend("dense")(q, k, v, spec, scale=SCALE)
  want = _numpy_reference(q, k, v, mask & np.tril(np.ones((T, T), bool)))
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["pallas", "cudnn"])
def test_other_backends_refuse_an_explicit_mask(backend):
  q, k, v, mask = _inputs(1)
  with pytest.raises(ValueError, match="explicit"):
    get_backend(backend)(q, k, v, _spec(mask), scale=SCALE)

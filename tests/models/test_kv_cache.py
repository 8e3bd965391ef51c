"""Cached decoding equals the full forward pass, for every family and position scheme."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.variants import forward, model_and_params, tokens
from tests.models.variants import DECODERS, ENCDECS, VARIANTS
from tests.tiers import slow_except

MAX_LEN = 12


def _empty_cache(module, batch, *prefix):
  """Cache variables for MAX_LEN slots, from shapes only (nothing is computed)."""
  ids = jnp.zeros((batch, MAX_LEN), jnp.int32)
  init = functools.partial(module.init, decode=True)
  if prefix:  # encoder-decoder: (encoded,) precedes the decoder ids
    init = functools.partial(module.init, method="decode", decode=True)
  shapes = jax.eval_shape(init, jax.random.PRNGKey(0), *prefix, ids)["cache"]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _decode_in_chunks(name, chunks, segment_ids, positions, encoded=None, encoder_seg=None):
  module, params, _ = model_and_params(name)
  batch = chunks[0].shape[0]
  cache = _empty_cache(module, batch, *(() if encoded is None else (encoded,)))
  outs, start = [], 0
  for i, chunk in enumerate(chunks):
    sl = slice(start, start + chunk.shape[1])
    kwargs = dict(decode=True, mutable=["cache"])
    if encoded is None:
      logits, mutated = module.apply(
          {"params": params, "cache": cache},
          chunk,
          segment_ids=segment_ids[:, sl],
          positions=positions[:, sl],
          **kwargs,
      )
    else:
      logits, mutated = module.apply(
          {"params": params, "cache": cache},
          encoded if i == 0 else None,
          chunk,
          encoder_segment_ids=encoder_seg,
          decoder_segment_ids=segment_ids[:, sl],
          decoder_positions=positions[:, sl],
          method="decode",
          **kwargs,
      )
    cache = mutated["cache"]
    outs.append(np.asarray(logits))
    start += chunk.shape[1]
  return np.concatenate(outs, axis=1)


def _encode(name, src, seg=None):
  module, params, _ = model_and_params(name)
  return module.apply({"params": params}, src, encoder_segment_ids=seg, method="encode")


@pytest.mark.slow  # every family end to end; the fast tier keeps the cache-mechanics tests
@pytest.mark.parametrize("name", DECODERS + ENCDECS)
def test_prefill_then_steps_equals_full_forward(name):
  x = tokens(20, (2, 9))
  seg, pos = jnp.ones_like(x), jnp.broadcast_to(jnp.arange(9), x.shape)
  chunks = [x[:, :4]] + [x[:, i : i + 1] for i in range(4, 9)]
  if VARIANTS[name].family == "encdec":
    src = tokens(21, (2, 6))
    full = forward(name, src, x)
    cached = _decode_in_chunks(name, chunks, seg, pos, _encode(name, src), jnp.ones_like(src))
  else:
    full = forward(name, x)
    cached = _decode_in_chunks(name, chunks, seg, pos)
  np.testing.assert_allclose(cached, full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", slow_except(DECODERS + ENCDECS, "alibi", "t5_v1_0"))
def test_left_padded_prompts_of_different_lengths(name):
  """Row 1's prompt is 2 tokens shorter and left-padded; each row decodes as if alone."""
  x = tokens(22, (2, 8))
  seg = jnp.array([[1] * 8, [0, 0] + [1] * 6])
  pos = jnp.array([list(range(8)), [0, 0] + list(range(6))])
  x = x.at[1, :2].set(0)
  chunks = [x[:, :5], x[:, 5:6], x[:, 6:7], x[:, 7:8]]
  if VARIANTS[name].family == "encdec":
    src = tokens(23, (2, 6)).at[1, 4:].set(0)
    src_seg = jnp.array([[1] * 6, [1] * 4 + [0, 0]])
    cached = _decode_in_chunks(name, chunks, seg, pos, _encode(name, src, src_seg), src_seg)
    alone = [forward(name, src[:1], x[:1]), forward(name, src[1:, :4], x[1:, 2:])]
  else:
    cached = _decode_in_chunks(name, chunks, seg, pos)
    alone = [forward(name, x[:1]), forward(name, x[1:, 2:])]
  np.testing.assert_allclose(cached[0], alone[0][0], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(cached[1, 2:], alone[1][0], atol=2e-5, rtol=1e-5)


def test_gqa_cache_holds_kv_heads_only():
  module, _, _ = model_and_params("llama")
  cache = _empty_cache(module, 3)
  key = cache["stack"]["layer_0"]["self_attention"]["cached_key"]
  # Stored [B, K, S, H]: the layout the attention product reads, no per-step transpose.
  assert key.shape == (3, VARIANTS["llama"].num_kv_heads, MAX_LEN, VARIANTS["llama"].head_dim)


@pytest.mark.slow  # T5's cache; the fast tier decodes t5_v1_0's cross-attention above
def test_cross_attention_kv_are_computed_once():
  """After the prefill call, decode steps read cached cross K/V: `encoded` is not needed."""
  module, params, _ = model_and_params("t5")
  src = tokens(24, (1, 5))
  encoded = _encode("t5", src)
  cache = _empty_cache(module, 1, encoded)
  _, mutated = module.apply(
      {"params": params, "cache": cache},
      encoded,
      tokens(25, (1, 1)),
      method="decode",
      decode=True,
      mutable=["cache"],
  )
  cross = mutated["cache"]["decoder"]["layer_0"]["cross_attention"]
  assert cross["cross_key"].shape[1] == 5
  step = tokens(26, (1, 1))
  reused, _ = module.apply(
      {"params": params, "cache": mutated["cache"]},
      None,
      step,
      method="decode",
      decode=True,
      mutable=["cache"],
  )
  recomputed, _ = module.apply(
      {"params": params, "cache": mutated["cache"]},
      encoded,
      step,
      method="decode",
      decode=True,
      mutable=["cache"],
  )
  np.testing.assert_array_equal(np.asarray(reused), np.asarray(recomputed))

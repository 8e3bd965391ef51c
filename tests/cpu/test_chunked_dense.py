"""The `dense` backend under the `cpu` kernels (tx_jax/cpu/chunked_attention.py): causal
query chunks and a hand-written VJP, against autodiff of the reference `dense_attention`.

Runs on every CPU: without MKL the chunks take XLA's layouts (tests/cpu/test_chunked_attention.py
covers the in-place MKL path)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.layers.test_attention_backends import (
    MASK_CASES,
    S,
    SCALE,
    T,
    N,
    _assert_equal_to_dense,
    _autodiff_dense,
    _qkv,
    _spec,
)
from tx_jax.cpu import chunked_attention
from tx_jax.layers.attention import AttentionSpec


def _dense_in_chunks(query_chunks):
  return functools.partial(chunked_attention.dense_attention, query_chunks=query_chunks)


# None: the default (one chunk at T = 11); 3: chunks of 4, 3, 4 queries; T: one query each.
@pytest.mark.parametrize("query_chunks", [None, 3, T])
@pytest.mark.parametrize("kind,num_kv_heads", MASK_CASES)
def test_dense_equals_autodiff_of_the_reference(kind, num_kv_heads, query_chunks):
  spec = _spec(kind)
  q, k, v = _qkv(num_kv_heads, key_length=S if kind == "cross" else T)
  _assert_equal_to_dense(
      _dense_in_chunks(query_chunks), spec, q, k, v, reference=_autodiff_dense
  )


@pytest.mark.parametrize(
    "kind,bias_kind,num_kv_heads",
    [("none", "t5", N), ("causal+packing", "t5", 2), ("causal", "alibi", 1)],
)
def test_dense_equals_autodiff_of_the_reference_with_bias(kind, bias_kind, num_kv_heads):
  spec = _spec(kind, bias_kind)
  _assert_equal_to_dense(_dense_in_chunks(3), spec, *_qkv(num_kv_heads), reference=_autodiff_dense)


@pytest.mark.parametrize("kind", ["none", "causal+packing", "cross"])
def test_dense_forward_is_bit_identical_to_the_reference(kind):
  """One chunk runs the reference's very softmax; only the backward is hand-written."""
  spec = _spec(kind)
  q, k, v = _qkv(2, key_length=S if kind == "cross" else T)
  got = jax.jit(_dense_in_chunks(1), static_argnames="scale")(q, k, v, spec, scale=SCALE)
  want = jax.jit(_autodiff_dense, static_argnames="scale")(q, k, v, spec, scale=SCALE)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_dense_chunks_only_causal_self_attention():
  long_causal = AttentionSpec.self_attention(jnp.ones((1, 256), jnp.int32), causal=True)
  assert chunked_attention.causal_chunk_bounds(long_causal, None) == [0, 64, 128, 192, 256]
  assert chunked_attention.causal_chunk_bounds(long_causal.replace(causal=False), None) == [0, 256]
  # Indices given by the caller: key order need not be query order, so no chunks.
  custom_index = AttentionSpec.self_attention(
      jnp.ones((1, 256), jnp.int32), causal=True, index_BT=jnp.zeros((1, 256), jnp.int32)
  )
  assert chunked_attention.causal_chunk_bounds(custom_index, None) == [0, 256]
  assert chunked_attention.causal_chunk_bounds(_spec("causal"), None) == [0, T]  # shorter than two chunks

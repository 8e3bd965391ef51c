"""Position information: sinusoidal, learned absolute, RoPE, T5 relative bias, ALiBi.

Absolute schemes return embeddings added to the token embeddings; RoPE
rotates queries and keys inside attention; T5 relative bias and ALiBi return an
additive attention bias [B|1, N, T, S] that the model computes once per stack
and hands to every layer.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from tx_jax.layers import axes

Array = jnp.ndarray


def sinusoidal_embedding(positions_BT: Array, dim: int, max_timescale: float = 10000.0) -> Array:
  """Sinusoidal embeddings for arbitrary integer positions (no table size limit)."""
  two_i = jnp.arange(0, dim, 2, dtype=jnp.float32)
  inv_freq = jnp.power(jnp.float32(max_timescale), -two_i / dim)
  angles_BTI = positions_BT[..., None].astype(jnp.float32) * inv_freq
  interleaved = jnp.stack([jnp.sin(angles_BTI), jnp.cos(angles_BTI)], axis=-1)
  return interleaved.reshape(*positions_BT.shape, -1)[..., :dim]


class LearnedPositions(nn.Module):
  """Learned absolute position embeddings (BERT, GPT-2)."""

  max_len: int
  dim: int
  embedding_init: nn.initializers.Initializer = nn.initializers.normal(0.02)
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, positions_BT: Array) -> Array:
    table = self.param(
        "embedding",
        nn.with_logical_partitioning(self.embedding_init, (axes.POSITION, axes.EMBED)),
        (self.max_len, self.dim),
        self.param_dtype,
    )
    return jnp.take(table, positions_BT, axis=0).astype(self.dtype)


def apply_rope(x_BTNH: Array, positions_BT: Array, theta: float) -> Array:
  """Rotary embedding in the half-split layout (HF LLaMA): x·cos + rotate_half(x)·sin."""
  head_dim = x_BTNH.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs_BTI = positions_BT[..., None].astype(jnp.float32) * inv_freq
  angles_BTH = jnp.concatenate([freqs_BTI, freqs_BTI], axis=-1)[:, :, None, :]
  x = x_BTNH.astype(jnp.float32)
  half = head_dim // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  out = x * jnp.cos(angles_BTH) + rotated * jnp.sin(angles_BTH)
  return out.astype(x_BTNH.dtype)


def t5_relative_position_bucket(
    relative_position: Array, bidirectional: bool, num_buckets: int, max_distance: int
) -> Array:
  """T5's bucketing of key_position - query_position: exact when small, log-spaced when large."""
  buckets = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    buckets = buckets + (relative_position > 0).astype(relative_position.dtype) * num_buckets
    distance = jnp.abs(relative_position)
  else:
    distance = -jnp.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  # Guard log(0): those entries take the exact branch anyway.
  log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact)
  if max_distance > max_exact:
    large = max_exact + (
        log_ratio / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(relative_position.dtype)
    large = jnp.minimum(large, num_buckets - 1)
  else:
    # No log-spaced range (the formula would divide by log(1) = 0 and cast NaN to an
    # index): every distance past the exact ones shares the last bucket.
    large = jnp.full_like(distance, num_buckets - 1)
  return buckets + jnp.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
  """T5 relative position bias: one learned scalar per (bucket, head), shared by a stack."""

  num_heads: int
  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool = True
  embedding_init: nn.initializers.Initializer = nn.initializers.normal(1.0)
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, query_positions_BT: Array, key_positions_BS: Array) -> Array:
    """Returns the additive bias [B, N, T, S]."""
    table = self.param(
        "rel_embedding",
        nn.with_logical_partitioning(self.embedding_init, (axes.RELPOS_BUCKETS, axes.HEADS)),
        (self.num_buckets, self.num_heads),
        self.param_dtype,
    )
    relative_BTS = key_positions_BS[:, None, :] - query_positions_BT[:, :, None]
    buckets_BTS = t5_relative_position_bucket(
        relative_BTS, self.bidirectional, self.num_buckets, self.max_distance
    )
    bias_BTSN = jnp.take(table, buckets_BTS, axis=0)
    return jnp.transpose(bias_BTSN, (0, 3, 1, 2)).astype(jnp.float32)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi head slopes (Press et al.): a geometric sequence, interleaved for non powers of 2."""

  def power_of_2_slopes(n: int) -> list[float]:
    start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    return [start ** (i + 1) for i in range(n)]

  if math.log2(num_heads).is_integer():
    slopes = power_of_2_slopes(num_heads)
  else:
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_2_slopes(closest)
    slopes += power_of_2_slopes(2 * closest)[0::2][: num_heads - closest]
  return np.asarray(slopes, dtype=np.float32)


def alibi_bias(query_positions_BT: Array, key_positions_BS: Array, num_heads: int) -> Array:
  """ALiBi additive bias [B, N, T, S] = -slope_n · |query_position - key_position|."""
  distance_BTS = jnp.abs(query_positions_BT[:, :, None] - key_positions_BS[:, None, :])
  slopes_N = jnp.asarray(alibi_slopes(num_heads))
  return -slopes_N[None, :, None, None] * distance_BTS[:, None].astype(jnp.float32)

"""The reference attention, softmax(Q·Kᵀ·scale + bias)·V over the whole [T, S] scores, and the
helpers every backend shares: grouping query heads for GQA, the logits, the masked softmax.

`dense` is the `dense` backend: it materialises the spec's mask [B, 1|N, T, S] and bias
[B|1, N, T, S] and computes one softmax, under JAX's own autodiff. `dense_attention` and
`dense_attention_over_parts` are the same computation on tensors, which KV-cache decoding
uses. Shapes: q_BTNH, k_BSKH, v_BSKH with N query heads and K key/value heads, K dividing N;
grouped queries are [B, T, K, G, H] with G = N / K.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tx_jax.layers import ops
from tx_jax.layers.attention.spec import AttentionSpec

Array = jnp.ndarray


def group_queries(q_BTNH: Array, num_kv_heads: int) -> Array:
  """[B, T, N, H] -> [B, T, K, G, H]: the query heads grouped by the key head they share."""
  batch, length, num_heads, head_dim = q_BTNH.shape
  return q_BTNH.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)


def to_groups(x_BNTS: Array, num_kv_heads: int) -> Array:
  """A mask or bias [B|1, N|1, T, S] -> [B|1, K|1, G|1, T, S], to broadcast over grouped heads."""
  b, n, t, s = x_BNTS.shape
  if n == 1:
    return x_BNTS[:, :, None]
  return x_BNTS.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


def grouped_logits(
    q_BTKGH: Array,
    k_BSKH: Array,
    mask_BNTS: Array | None,
    bias: Array | None,
    scale: float,
    einsum=ops.einsum,
) -> Array:
  """q·kᵀ scaled, biased and masked (masked keys at the f32 minimum): f32 [B, K, G, T, S]."""
  products_BKGTS = einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  return scaled_logits(products_BKGTS, mask_BNTS, bias, scale)


def scaled_logits(
    products_BKGTS: Array, mask_BNTS: Array | None, bias: Array | None, scale: float
) -> Array:
  """q·kᵀ [B, K, G, T, S] scaled, biased and masked (masked keys at the f32 minimum)."""
  num_kv_heads = products_BKGTS.shape[1]
  logits_BKGTS = products_BKGTS * jnp.float32(scale)
  if bias is not None:
    logits_BKGTS = logits_BKGTS + to_groups(bias.astype(jnp.float32), num_kv_heads)
  if mask_BNTS is not None:
    mask = to_groups(mask_BNTS, num_kv_heads)
    logits_BKGTS = jnp.where(mask, logits_BKGTS, jnp.finfo(jnp.float32).min)
  return logits_BKGTS


def masked_softmax(logits_BKGTS: Array, mask_BNTS: Array | None) -> Array:
  """softmax over the keys; masked keys get exactly zero weight, and a row with no visible
  key (whose softmax over equal minima is uniform) becomes all zeros."""
  weights_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1)
  if mask_BNTS is not None:
    weights_BKGTS = jnp.where(to_groups(mask_BNTS, logits_BKGTS.shape[1]), weights_BKGTS, 0.0)
  return weights_BKGTS


def weighted_values(weights_BKGTS: Array, v_BSKH: Array, einsum=ops.einsum) -> Array:
  """Σ_s w·v as [B, T, K, G, H]."""
  out_BKGTH = einsum("bkgts,bskh->bkgth", weights_BKGTS.astype(v_BSKH.dtype), v_BSKH)
  return jnp.moveaxis(out_BKGTH, 3, 1)


def dense_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    mask_BNTS: Array | None,
    bias: Array | None,
    *,
    scale: float,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
) -> Array:
  """Reference attention on tensors; materialises the [B, N, T, S] weights. Softmax in f32.

  mask_BNTS: bool [B|1, 1|N, T, S], True = attend, or None. bias: broadcastable to
  [B, N, T, S], or None.
  """
  q_BTKGH = group_queries(q_BTNH, k_BSKH.shape[2])
  logits_BKGTS = grouped_logits(q_BTKGH, k_BSKH, mask_BNTS, bias, scale)
  weights_BKGTS = masked_softmax(logits_BKGTS, mask_BNTS)
  if not deterministic and dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights_BKGTS.shape)
    weights_BKGTS = jnp.where(keep, weights_BKGTS / (1.0 - dropout_rate), 0.0)
  return weighted_values(weights_BKGTS, v_BSKH).reshape(q_BTNH.shape)


class KeyValuePart(NamedTuple):
  """One slice of the keys a query sees: K/V [B, S_i, K, H], mask [B,1,T,S_i], bias or None."""

  k_BSKH: Array
  v_BSKH: Array
  mask_BNTS: Array
  bias: Array | None


def dense_attention_over_parts(
    q_BTNH: Array, parts: Sequence[KeyValuePart], *, scale: float
) -> Array:
  """dense_attention over the keys of all parts at once (one softmax), without concatenating
  K/V: only the small logits are joined. The chunked KV cache decodes through this, reading
  the long cache in place and the recent keys from a short buffer. No dropout (inference)."""
  q_BTKGH = group_queries(q_BTNH, parts[0].k_BSKH.shape[2])
  logits = [grouped_logits(q_BTKGH, p.k_BSKH, p.mask_BNTS, p.bias, scale) for p in parts]
  mask_BNTS = jnp.concatenate([p.mask_BNTS for p in parts], axis=-1)
  weights_BKGTS = masked_softmax(jnp.concatenate(logits, axis=-1), mask_BNTS)
  out_BTKGH, start = 0, 0
  for part in parts:
    size = part.k_BSKH.shape[1]
    out_BTKGH = out_BTKGH + weighted_values(weights_BKGTS[..., start : start + size], part.v_BSKH)
    start += size
  return out_BTKGH.reshape(q_BTNH.shape)


def dense(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    spec: AttentionSpec,
    *,
    scale: float,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
    kernels: ops.Kernels = ops.get(ops.PLAIN),
) -> Array:
  """The `dense` backend: one softmax over the spec's whole [T, S] mask and bias.

  A kernel set with its own `dense_attention` (`layers.ops`) computes it instead where
  there is no attention dropout.
  """
  dropout = not deterministic and dropout_rate > 0.0
  if kernels.dense_attention is not None and not dropout:
    return kernels.dense_attention(q_BTNH, k_BSKH, v_BSKH, spec, scale=scale)
  return dense_attention(
      q_BTNH,
      k_BSKH,
      v_BSKH,
      spec.mask(),
      spec.bias_logits(),
      scale=scale,
      dropout_rate=dropout_rate,
      dropout_rng=dropout_rng,
      deterministic=deterministic,
  )

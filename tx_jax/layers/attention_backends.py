"""Attention backends: softmax(Q·Kᵀ·scale + bias)·V given q, k, v and an `AttentionSpec`.

A backend receives a description of what may attend to what (`layers.attention_spec`:
segment ids, indices, positions, causal flag, window, bias parameters) and materialises
only what it needs: `dense` the whole [B, T, S] mask and [B, N, T, S] bias, `blockwise`
one block at a time, `pallas` segment ids only, `cudnn` a mask and bias tensor (cuDNN's
interface). Adding a backend means writing one function and registering it in `BACKENDS`.

Shapes: q_BTNH, k_BSKH, v_BSKH with N query heads and K key/value heads, K dividing N
(grouped-query attention). `dense_attention` and `dense_attention_over_parts` are the
tensor-level reference (mask_B1TS boolean, True = attend; bias broadcastable to
[B, N, T, S]) that `dense` and KV-cache decoding use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from tx_jax.layers.attention_spec import AttentionSpec
from tx_jax.layers.blockwise_attention import blockwise_attention

Array = jnp.ndarray


def _group_queries(q_BTNH: Array, num_kv_heads: int) -> Array:
  batch, length, num_heads, head_dim = q_BTNH.shape
  return q_BTNH.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)


def _bias_to_groups(bias: Array, num_kv_heads: int) -> Array:
  """[B|1, N|1, T, S] -> [B|1, K|1, G|1, T, S] so it broadcasts against grouped logits."""
  b, n, t, s = bias.shape
  if n == 1:
    return bias[:, :, None]
  return bias.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


def _zero_fully_masked_rows(out_BTNH: Array, mask_B1TS: Array | None) -> Array:
  """A query whose keys are all masked attends to nothing: its output is exactly 0."""
  if mask_B1TS is None:
    return out_BTNH
  any_key_BT = jnp.any(mask_B1TS[:, 0], axis=-1)
  return jnp.where(any_key_BT[:, :, None, None], out_BTNH, 0).astype(out_BTNH.dtype)


def _grouped_logits(
    q_BTKGH: Array, k_BSKH: Array, mask_B1TS: Array | None, bias: Array | None, scale: float
) -> Array:
  """Scaled, biased, masked float32 logits [B, K, G, T, S] (masked keys at the f32 minimum)."""
  num_kv_heads = k_BSKH.shape[2]
  logits_BKGTS = jnp.einsum(
      "btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32
  )
  logits_BKGTS = logits_BKGTS * jnp.float32(scale)
  if bias is not None:
    logits_BKGTS = logits_BKGTS + _bias_to_groups(bias.astype(jnp.float32), num_kv_heads)
  if mask_B1TS is not None:
    logits_BKGTS = jnp.where(mask_B1TS[:, :, None], logits_BKGTS, jnp.finfo(jnp.float32).min)
  return logits_BKGTS


def _masked_softmax(logits_BKGTS: Array, mask_B1TS: Array | None) -> Array:
  weights_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1)
  if mask_B1TS is not None:
    # Masked keys get exactly zero weight, and fully masked rows (whose
    # softmax over equal minima is uniform) become all-zero.
    weights_BKGTS = jnp.where(mask_B1TS[:, :, None], weights_BKGTS, 0.0)
  return weights_BKGTS


def _weighted_values(weights_BKGTS: Array, v_BSKH: Array) -> Array:
  """sum_s w·v as [B, T, K, G, H]; the product is laid out [B, K, G, T, H], which XLA on
  CPU computes without transposing V (a [B, T, ...] output made it copy V every step)."""
  out_BKGTH = jnp.einsum("bkgts,bskh->bkgth", weights_BKGTS.astype(v_BSKH.dtype), v_BSKH)
  return jnp.moveaxis(out_BKGTH, 3, 1)


def dense_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    mask_B1TS: Array | None,
    bias: Array | None,
    *,
    scale: float,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
) -> Array:
  """Reference XLA attention; materialises the [B, N, T, S] weights. Softmax in float32."""
  q_BTKGH = _group_queries(q_BTNH, k_BSKH.shape[2])
  logits_BKGTS = _grouped_logits(q_BTKGH, k_BSKH, mask_B1TS, bias, scale)
  weights_BKGTS = _masked_softmax(logits_BKGTS, mask_B1TS)
  if not deterministic and dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights_BKGTS.shape)
    weights_BKGTS = jnp.where(keep, weights_BKGTS / (1.0 - dropout_rate), 0.0)
  return _weighted_values(weights_BKGTS, v_BSKH).reshape(q_BTNH.shape)


class KeyValuePart(NamedTuple):
  """One slice of the keys a query sees: K/V [B, S_i, K, H], mask [B,1,T,S_i], bias or None."""

  k_BSKH: Array
  v_BSKH: Array
  mask_B1TS: Array
  bias: Array | None


def dense_attention_over_parts(
    q_BTNH: Array, parts: Sequence[KeyValuePart], *, scale: float
) -> Array:
  """dense_attention over the keys of all parts at once (one softmax), without concatenating
  K/V: only the small logits are joined. The chunked KV cache decodes through this, reading
  the long cache in place and the recent keys from a short buffer. No dropout (inference)."""
  q_BTKGH = _group_queries(q_BTNH, parts[0].k_BSKH.shape[2])
  logits = [_grouped_logits(q_BTKGH, p.k_BSKH, p.mask_B1TS, p.bias, scale) for p in parts]
  mask_B1TS = jnp.concatenate([p.mask_B1TS for p in parts], axis=-1)
  weights_BKGTS = _masked_softmax(jnp.concatenate(logits, axis=-1), mask_B1TS)
  out_BTKGH, start = 0, 0
  for part in parts:
    size = part.k_BSKH.shape[1]
    out_BTKGH = out_BTKGH + _weighted_values(weights_BKGTS[..., start : start + size], part.v_BSKH)
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
) -> Array:
  """The `dense` backend: materialises the full [B, T, S] mask and [B, N, T, S] bias."""
  return dense_attention(
      q_BTNH,
      k_BSKH,
      v_BSKH,
      spec.mask()[:, None],
      spec.bias_logits(),
      scale=scale,
      dropout_rate=dropout_rate,
      dropout_rng=dropout_rng,
      deterministic=deterministic,
  )


def _no_dropout(backend: str, dropout_rate: float, deterministic: bool) -> None:
  if not deterministic and dropout_rate > 0.0:
    raise ValueError(
        f"attention backend {backend!r} has no attention dropout; set "
        f"model.attention_dropout_rate=0 (got {dropout_rate}) or model.attention_backend='dense'"
    )


def cudnn(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    spec: AttentionSpec,
    *,
    scale: float,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
) -> Array:
  """The `cudnn` backend: jax.nn.dot_product_attention's fused cuDNN kernel (NVIDIA GPU)."""
  del dropout_rng
  _no_dropout("cudnn", dropout_rate, deterministic)
  if jax.default_backend() != "gpu":
    raise ValueError(
        f"model.attention_backend='cudnn' needs an NVIDIA GPU, but JAX runs on "
        f"{jax.default_backend()!r}; use 'dense' or 'blockwise' there"
    )
  if q_BTNH.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(
        f"model.attention_backend='cudnn' computes in bfloat16 or float16, got {q_BTNH.dtype}; "
        "set model.dtype='bfloat16' or use 'dense' / 'blockwise'"
    )
  mask_B1TS = spec.mask()[:, None]
  bias_BNTS = spec.bias_logits()
  if bias_BNTS is not None:
    bias_BNTS = jnp.broadcast_to(
        bias_BNTS, (q_BTNH.shape[0], q_BTNH.shape[2], q_BTNH.shape[1], k_BSKH.shape[1])
    ).astype(q_BTNH.dtype)
  out = jax.nn.dot_product_attention(
      q_BTNH,
      k_BSKH,
      v_BSKH,
      bias=bias_BNTS,
      mask=mask_B1TS,
      scale=scale,
      implementation="cudnn",
  )
  return _zero_fully_masked_rows(out, mask_B1TS)


def _pallas(q_BTNH, k_BSKH, v_BSKH, spec, *, scale, **dropout) -> Array:
  # Imported on use: the Pallas/Triton modules are only needed by this backend.
  from tx_jax.layers.pallas_attention import pallas_attention

  return pallas_attention(q_BTNH, k_BSKH, v_BSKH, spec, scale=scale, **dropout)


# Every backend: (q_BTNH, k_BSKH, v_BSKH, spec, *, scale, dropout_rate, dropout_rng,
# deterministic) -> out_BTNH, equal to `dense` within float32 tolerance.
BACKENDS: dict[str, Callable[..., Array]] = {
    "dense": dense,
    "blockwise": blockwise_attention,
    "cudnn": cudnn,
    "pallas": _pallas,
}


def get_backend(name: str) -> Callable[..., Array]:
  """Looks up an attention backend by name, with an error listing the accepted ones."""
  if name not in BACKENDS:
    raise ValueError(f"model.attention_backend={name!r} is not one of {sorted(BACKENDS)}")
  return BACKENDS[name]

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

from tx_jax.layers import cpu_einsum
from tx_jax.layers.attention_spec import AttentionSpec
from tx_jax.layers.blockwise_attention import blockwise_attention
from tx_jax.layers.chunked_attention import Chunk, chunked_attention, group_queries, grouped_logits

Array = jnp.ndarray


def _zero_fully_masked_rows(out_BTNH: Array, mask_B1TS: Array | None) -> Array:
  """A query whose keys are all masked attends to nothing: its output is exactly 0."""
  if mask_B1TS is None:
    return out_BTNH
  any_key_BT = jnp.any(mask_B1TS[:, 0], axis=-1)
  return jnp.where(any_key_BT[:, :, None, None], out_BTNH, 0).astype(out_BTNH.dtype)


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
  out_BKGTH = cpu_einsum.einsum("bkgts,bskh->bkgth", weights_BKGTS.astype(v_BSKH.dtype), v_BSKH)
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
  q_BTKGH = group_queries(q_BTNH, k_BSKH.shape[2])
  logits_BKGTS = grouped_logits(q_BTKGH, k_BSKH, mask_B1TS, bias, scale)
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
  q_BTKGH = group_queries(q_BTNH, parts[0].k_BSKH.shape[2])
  logits = [grouped_logits(q_BTKGH, p.k_BSKH, p.mask_B1TS, p.bias, scale) for p in parts]
  mask_B1TS = jnp.concatenate([p.mask_B1TS for p in parts], axis=-1)
  weights_BKGTS = _masked_softmax(jnp.concatenate(logits, axis=-1), mask_B1TS)
  out_BTKGH, start = 0, 0
  for part in parts:
    size = part.k_BSKH.shape[1]
    out_BTKGH = out_BTKGH + _weighted_values(weights_BKGTS[..., start : start + size], part.v_BSKH)
    start += size
  return out_BTKGH.reshape(q_BTNH.shape)


# Causal self-attention splits its queries into this many chunks, each attending only to
# the keys up to its last query: with 4, 10/16 of the [T, T] scores are computed. At the
# bench shape (T 256, 8 heads of 64) attention fwd+bwd ran 1.33x faster with 4 chunks than
# with 1, 1.2x with 8 and 0.84x with 16 (docs/performance_cpu_changes.md); chunks stay
# >= 64 queries.
CAUSAL_QUERY_CHUNKS = 4
MIN_QUERY_CHUNK = 64


def _causal_chunk_bounds(spec: AttentionSpec, query_chunks: int | None) -> list[int]:
  """Query chunk boundaries [0, ..., T]; one chunk unless the keys are the causal queries."""
  length = spec.query_length
  if not (spec.causal and spec.same_tokens and length == spec.key_length):
    return [0, length]
  if query_chunks is None:
    query_chunks = max(1, min(CAUSAL_QUERY_CHUNKS, length // MIN_QUERY_CHUNK))
  query_chunks = min(query_chunks, length)
  return [round(i * length / query_chunks) for i in range(query_chunks + 1)]


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
    query_chunks: int | None = None,
) -> Array:
  """The `dense` backend: XLA einsums over the whole [T, S] mask and [B, N, T, S] bias.

  Without dropout it runs `chunked_attention` (`dense_attention`'s softmax, a hand-written
  backward; on CPU, MKL reads q, k and v in place), and causal self-attention skips the
  keys after each query chunk (`query_chunks`; None: `CAUSAL_QUERY_CHUNKS`). With attention
  dropout it is `dense_attention` under autodiff.
  """
  if not deterministic and dropout_rate > 0.0:
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
  bounds = _causal_chunk_bounds(spec, query_chunks)
  if len(bounds) == 2:
    chunks, specs = (Chunk(0, spec.query_length, spec.key_length),), [spec]
  else:
    # A chunk's queries see no key after its last query: those keys are left out.
    chunks = tuple(Chunk(start, end, end) for start, end in zip(bounds[:-1], bounds[1:]))
    specs = [spec.queries(c.start, c.end - c.start).keys(0, c.key_end) for c in chunks]
  masks = tuple(s.mask()[:, None] for s in specs)
  biases = tuple(s.bias_logits() for s in specs)
  bias_shapes = tuple(None if b is None else b.shape for b in biases)
  q_BTKGH = group_queries(q_BTNH, k_BSKH.shape[2])
  out_BTKGH = chunked_attention(q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes)
  return out_BTKGH.reshape(q_BTNH.shape)


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
  if q_BTNH.dtype.name not in CUDNN_DTYPES:
    raise ValueError(
        f"model.attention_backend='cudnn' computes in bfloat16 or float16, got {q_BTNH.dtype}; "
        "set model.dtype='bfloat16' or use 'dense' / 'blockwise'"
    )
  # cuDNN's training kernels refuse odd lengths once a mask or bias is given: pad T and S
  # to even with masked keys (the padded query rows are dropped below).
  batch, length, num_heads, _ = q_BTNH.shape
  key_length = k_BSKH.shape[1]
  pad_t, pad_s = length % 2, key_length % 2
  mask_B1TS = spec.mask()[:, None]
  bias_BNTS = spec.bias_logits()
  if bias_BNTS is not None:
    bias_BNTS = jnp.broadcast_to(bias_BNTS, (batch, num_heads, length, key_length))
    bias_BNTS = jnp.pad(bias_BNTS, ((0, 0), (0, 0), (0, pad_t), (0, pad_s))).astype(q_BTNH.dtype)
  pad_seq = lambda x, n: jnp.pad(x, ((0, 0), (0, n), (0, 0), (0, 0)))  # noqa: E731
  out = jax.nn.dot_product_attention(
      pad_seq(q_BTNH, pad_t),
      pad_seq(k_BSKH, pad_s),
      pad_seq(v_BSKH, pad_s),
      bias=bias_BNTS,
      mask=jnp.pad(mask_B1TS, ((0, 0), (0, 0), (0, pad_t), (0, pad_s))),
      scale=scale,
      # The mask already holds causality; the flag also lets cuDNN skip the key blocks
      # above the diagonal. cuDNN's causality is by array position, which is the spec's
      # index causality only when the indices are 0..T-1 for queries and keys alike.
      is_causal=spec.causal and spec.same_tokens,
      implementation="cudnn",
  )[:, :length]
  return _zero_fully_masked_rows(out, mask_B1TS)


def _pallas(q_BTNH, k_BSKH, v_BSKH, spec, *, scale, **dropout) -> Array:
  # Imported on use: the Pallas/Triton modules are only needed by this backend.
  from tx_jax.layers.pallas_attention import pallas_attention

  return pallas_attention(q_BTNH, k_BSKH, v_BSKH, spec, scale=scale, **dropout)


# What the backends cannot do, for tx_jax.validation to refuse a config before any work
# (each backend also raises on its own when called).
GPU_ONLY_BACKENDS = ("cudnn", "pallas")
NO_DROPOUT_BACKENDS = ("blockwise", "cudnn", "pallas")
CUDNN_DTYPES = ("bfloat16", "float16")

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

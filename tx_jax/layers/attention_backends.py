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

import functools
from collections.abc import Sequence
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from tx_jax.layers import cpu_gemm
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
  logits_BKGTS = cpu_gemm.einsum(
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
  out_BKGTH = cpu_gemm.einsum("bkgts,bskh->bkgth", weights_BKGTS.astype(v_BSKH.dtype), v_BSKH)
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


def _probabilities(
    q_BTKGH: Array, k_BSKH: Array, mask_B1TS: Array, bias: Array | None, scale: float
) -> Array:
  """softmax over the visible keys [B, K, G, T, S] f32; rows with no visible key are 0.

  The same operations as `dense_attention`'s softmax, so the forward is bit-identical.
  """
  logits_BKGTS = _grouped_logits(q_BTKGH, k_BSKH, mask_B1TS, bias, scale)
  row_max = jax.lax.stop_gradient(jnp.max(logits_BKGTS, axis=-1, keepdims=True))
  exp_BKGTS = jnp.where(mask_B1TS[:, :, None], jnp.exp(logits_BKGTS - row_max), 0.0)
  row_sum = jnp.sum(exp_BKGTS, axis=-1, keepdims=True)
  return exp_BKGTS / jnp.where(row_sum > 0, row_sum, 1.0)


def _sum_to_shape(x: Array, shape: tuple[int, ...]) -> Array:
  """Sums x over the axes that `shape` broadcasts (size 1), the adjoint of broadcasting."""
  axes_ = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
  return jnp.sum(x, axis=axes_, keepdims=True).reshape(shape)


class Chunk(NamedTuple):
  """Queries [start, end) of a `_chunked_attention` call attend to keys [0, key_end)."""

  start: int
  end: int
  key_end: int


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _chunked_attention(q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes):
  """[B, K, G, T, H] = softmax(q·kᵀ·scale + bias, masked)·v, by query chunks, hand-written VJP.

  chunks: a `Chunk` per query chunk; masks[i] ([B, 1, T_i, S_i] bool) and biases[i]
  (None or broadcastable to [B, N, T_i, S_i]) describe chunk i's queries against its keys.
  bias_shapes: the biases' shapes (static), None where there is no bias.
  """
  return _chunked_attention_fwd(
      q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes
  )[0]


def _chunked_attention_fwd(q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes):
  del bias_shapes  # the backward's
  probabilities, outputs = [], []
  for chunk, mask_B1TS, bias in zip(chunks, masks, biases):
    keys = slice(0, chunk.key_end)
    p_BKGTS = _probabilities(
        q_BTKGH[:, chunk.start : chunk.end], k_BSKH[:, keys], mask_B1TS, bias, scale
    )
    probabilities.append(p_BKGTS)
    p_BKGTS = p_BKGTS.astype(v_BSKH.dtype)
    outputs.append(cpu_gemm.einsum("bkgts,bskh->bkgth", p_BKGTS, v_BSKH[:, keys]))
  out_BKGTH = jnp.concatenate(outputs, axis=3) if len(outputs) > 1 else outputs[0]
  return out_BKGTH, (q_BTKGH, k_BSKH, v_BSKH, tuple(probabilities), out_BKGTH)


def _chunked_attention_bwd(scale, chunks, bias_shapes, residuals, dout_BKGTH):
  """FlashAttention's backward with the probabilities kept: d logits = p·(dp − Σ dout·out).

  Σ_s p·dp equals Σ_h dout·out, a [B, K, G, T] reduction over the head dimension instead
  of a second pass over [T, S] (what autodiff of the softmax does), and masked keys have
  p = 0, so no mask is applied again.

  Layouts: XLA:CPU's dot wants the batch dims (B, K) leading, the left operand contracted
  on its last dim and the right one on its first. Each operand is put in that layout once
  for all chunks ([B, K, H, S] for v, [B, K, S, H] for k, [B, K, H, G, T] for q and dout),
  and dk, dv come out as [B, K, H, S], so the [T, S] probabilities are never transposed.
  Per-chunk einsums on the [B, T, K, H] inputs made XLA transpose every chunk's keys in
  two layouts, and pad-and-add each chunk's dk and dv (bench step 1.02-1.03x faster).
  One chunk has nothing to slice and keeps XLA's own layouts (`_one_chunk_bwd`).
  """
  if len(chunks) == 1:
    return _one_chunk_bwd(scale, bias_shapes[0], residuals, dout_BKGTH)
  q_BTKGH, k_BSKH, v_BSKH, probabilities, out_BKGTH = residuals
  f32 = jnp.float32
  q_BKHGT = q_BTKGH.transpose(0, 2, 4, 3, 1)
  dout_BKHGT = dout_BKGTH.transpose(0, 1, 4, 2, 3)
  k_BKSH = k_BSKH.transpose(0, 2, 1, 3)
  v_BKHS = v_BSKH.transpose(0, 2, 3, 1)
  row_dot_BKGT1 = _row_dot(dout_BKGTH, out_BKGTH)
  einsum = functools.partial(cpu_gemm.einsum, preferred_element_type=f32)
  dq_parts, dk_parts, dv_parts, dbiases = [], [], [], []
  for chunk, p_BKGTS, bias_shape in zip(chunks, probabilities, bias_shapes):
    queries, keys = slice(chunk.start, chunk.end), slice(0, chunk.key_end)
    dout_c = dout_BKGTH[:, :, :, queries]
    dp_BKGTS = einsum("bkgth,bkhs->bkgts", dout_c, v_BKHS[..., keys])
    dlogits_BKGTS = p_BKGTS * (dp_BKGTS - row_dot_BKGT1[:, :, :, queries])
    p_c = p_BKGTS.astype(dout_BKGTH.dtype)
    dv_parts.append(einsum("bkhgt,bkgts->bkhs", dout_BKHGT[..., queries], p_c))
    ds_BKGTS = dlogits_BKGTS.astype(k_BSKH.dtype)
    dq_parts.append(einsum("bkgts,bksh->bkgth", ds_BKGTS, k_BKSH[:, :, keys]))
    dk_parts.append(einsum("bkhgt,bkgts->bkhs", q_BKHGT[..., queries], ds_BKGTS))
    dbiases.append(_bias_gradient(dlogits_BKGTS, bias_shape))
  dq = (jnp.concatenate(dq_parts, axis=3) * scale).transpose(0, 3, 1, 2, 4)
  dk = (_by_key_block(dk_parts, chunks) * scale).transpose(0, 3, 1, 2)
  dv = _by_key_block(dv_parts, chunks).transpose(0, 3, 1, 2)
  return (
      dq.astype(q_BTKGH.dtype),
      dk.astype(k_BSKH.dtype),
      dv.astype(v_BSKH.dtype),
      None,
      tuple(dbiases),
  )


def _one_chunk_bwd(scale, bias_shape, residuals, dout_BKGTH):
  """`_chunked_attention_bwd` for one chunk (all queries against all keys): einsums on the
  inputs' layouts, whose transposes XLA places itself. With nothing sliced, laying the
  operands out by hand only added copies (`small`'s T = 64: 1.76 vs 1.54 ms fwd+bwd)."""
  q_BTKGH, k_BSKH, v_BSKH, (p_BKGTS,), out_BKGTH = residuals
  f32 = jnp.float32
  dp_BKGTS = cpu_gemm.einsum("bkgth,bskh->bkgts", dout_BKGTH, v_BSKH, preferred_element_type=f32)
  row_dot = _row_dot(dout_BKGTH, out_BKGTH)
  dlogits_BKGTS = p_BKGTS * (dp_BKGTS - row_dot)
  dv = cpu_gemm.einsum("bkgts,bkgth->bskh", p_BKGTS.astype(dout_BKGTH.dtype), dout_BKGTH)
  ds = dlogits_BKGTS.astype(k_BSKH.dtype)
  dq = cpu_gemm.einsum("bkgts,bskh->btkgh", ds, k_BSKH, preferred_element_type=f32) * scale
  dk = cpu_gemm.einsum("bkgts,btkgh->bskh", ds, q_BTKGH, preferred_element_type=f32) * scale
  return (
      dq.astype(q_BTKGH.dtype),
      dk.astype(k_BSKH.dtype),
      dv.astype(v_BSKH.dtype),
      None,
      (_bias_gradient(dlogits_BKGTS, bias_shape),),
  )


def _row_dot(dout_BKGTH: Array, out_BKGTH: Array) -> Array:
  """Σ_h dout·out as [B, K, G, T, 1] f32, the term the backward subtracts from dp.

  Written as an einsum, not sum(dout·out, -1): XLA turns it into the same multiply and
  reduce, but over (G, H) when G = 1, so no reshape sits between the reduce and p·(dp − ·).
  With the reshape, YNNPACK's fusion of the two ran 2.4-2.9x slower (tiny-shakespeare's
  step 1.03-1.04x, `small` 1.02x, bench 1.01x; docs/performance.md, twentieth part).
  """
  f32 = jnp.float32
  row_dot_BKGT = jnp.einsum(
      "bkgth,bkgth->bkgt",
      dout_BKGTH.astype(f32),
      out_BKGTH.astype(f32),
      precision=jax.lax.Precision.HIGHEST,  # a sum, never TF32 or bf16 passes on accelerators
  )
  return row_dot_BKGT[..., None]


def _bias_gradient(dlogits_BKGTS: Array, bias_shape: tuple[int, ...] | None) -> Array | None:
  """The bias's gradient: d logits summed over the axes the bias broadcast along."""
  if bias_shape is None:
    return None
  b, k, g, t, s = dlogits_BKGTS.shape
  return _sum_to_shape(dlogits_BKGTS.reshape(b, k * g, t, s), bias_shape)


def _by_key_block(parts_BKHS: list[Array], chunks: Sequence[Chunk]) -> Array:
  """Σ over chunks of each chunk's [B, K, H, key_end] gradient, as one [B, K, H, S]: each
  block of keys sums the chunks that saw it (one fusion, no padded copies)."""
  blocks, start = [], 0
  for end in sorted({chunk.key_end for chunk in chunks}):
    seen_by = [p for p, c in zip(parts_BKHS, chunks) if c.key_end >= end]
    blocks.append(functools.reduce(jnp.add, [p[..., start:end] for p in seen_by]))
    start = end
  return jnp.concatenate(blocks, axis=-1)


_chunked_attention.defvjp(_chunked_attention_fwd, _chunked_attention_bwd)

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

  Without dropout it runs `_chunked_attention` (the forward of `dense_attention`, a
  hand-written backward), and causal self-attention skips the keys after each query chunk
  (`query_chunks`; None: `CAUSAL_QUERY_CHUNKS`). With attention dropout it is
  `dense_attention` under autodiff.
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
  q_BTKGH = _group_queries(q_BTNH, k_BSKH.shape[2])
  out_BKGTH = _chunked_attention(
      q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes
  )
  return jnp.moveaxis(out_BKGTH, 3, 1).reshape(q_BTNH.shape)


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

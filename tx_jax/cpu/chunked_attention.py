"""The `dense` backend under the `cpu` kernels: causal queries in chunks, a hand-written VJP.

Causal self-attention's queries are split into chunks, each attending only to the keys up
to its last query (`Chunk`), so about 5/8 of the [T, T] scores are computed with 4 chunks;
all chunks run as one `custom_vjp` whose forward keeps each chunk's softmax probabilities
and whose backward is FlashAttention's, d logits = p·(dp − Σ dout·out). Two memory layouts:

- in place (float32 on CPU, through MKL): every q·kᵀ, p·v and gradient contraction is one
  `einsum.in_place_einsum`, which reads q, k, v and dout where they lie ([B, T, K, G, H], a
  chunk being an offset into them) and writes its result in the layout the next step wants;
- XLA's layouts (without MKL): operands laid out once per call for XLA's dot.

The forward equals the reference's (`layers.attention.dense`) bit for bit; its pieces come
from there. Reverse mode only. A spec with an explicit mask takes the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tx_jax.cpu import einsum as cpu_einsum
from tx_jax.layers.attention import dense
from tx_jax.layers.attention.spec import AttentionSpec

Array = jnp.ndarray


def grouped_logits(q_BTKGH, k_BSKH, mask_B1TS, bias, scale):
  """The reference's logits, with q·kᵀ through MKL where it applies."""
  return dense.grouped_logits(q_BTKGH, k_BSKH, mask_B1TS, bias, scale, cpu_einsum.einsum)


def _probabilities(logits_BKGTS: Array, mask_B1TS: Array) -> Array:
  """softmax over the visible keys [B, K, G, T, S] f32; rows with no visible key are 0.

  The same operations as `dense_attention`'s softmax, so the forward is bit-identical.
  """
  row_max = jax.lax.stop_gradient(jnp.max(logits_BKGTS, axis=-1, keepdims=True))
  exp_BKGTS = jnp.where(mask_B1TS[:, :, None], jnp.exp(logits_BKGTS - row_max), 0.0)
  row_sum = jnp.sum(exp_BKGTS, axis=-1, keepdims=True)
  return exp_BKGTS / jnp.where(row_sum > 0, row_sum, 1.0)


def _sum_to_shape(x: Array, shape: tuple[int, ...]) -> Array:
  """Sums x over the axes that `shape` broadcasts (size 1), the adjoint of broadcasting."""
  axes_ = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
  return jnp.sum(x, axis=axes_, keepdims=True).reshape(shape)


class Chunk(NamedTuple):
  """Queries [start, end) of a `chunked_attention` call attend to keys [0, key_end)."""

  start: int
  end: int
  key_end: int


def _with_vjp(forward, backward):
  """f(q, k, v, masks, biases, scale, chunks, bias_shapes) = forward(...)[0], differentiated
  by `backward`; the last three arguments are static."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
  def attention(q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes):
    return forward(q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes)[0]

  attention.defvjp(forward, backward)
  return attention


def _laid_out_attention_fwd(q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes):
  del bias_shapes  # the backward's
  probabilities, outputs = [], []
  for chunk, mask_B1TS, bias in zip(chunks, masks, biases):
    keys = slice(0, chunk.key_end)
    logits_BKGTS = grouped_logits(
        q_BTKGH[:, chunk.start : chunk.end], k_BSKH[:, keys], mask_B1TS, bias, scale
    )
    p_BKGTS = _probabilities(logits_BKGTS, mask_B1TS)
    probabilities.append(p_BKGTS)
    p_BKGTS = p_BKGTS.astype(v_BSKH.dtype)
    outputs.append(cpu_einsum.einsum("bkgts,bskh->bkgth", p_BKGTS, v_BSKH[:, keys]))
  out_BKGTH = jnp.concatenate(outputs, axis=3) if len(outputs) > 1 else outputs[0]
  return out_BKGTH, (q_BTKGH, k_BSKH, v_BSKH, tuple(probabilities), out_BKGTH)


def _laid_out_attention_bwd(scale, chunks, bias_shapes, residuals, dout_BKGTH):
  """FlashAttention's backward with the probabilities kept: d logits = p·(dp − Σ dout·out).

  Σ_s p·dp equals Σ_h dout·out, a [B, K, G, T] reduction over the head dimension instead
  of a second pass over [T, S] (what autodiff of the softmax does), and masked keys have
  p = 0, so no mask is applied again.

  Layouts: XLA:CPU's dot wants the batch dims (B, K) leading, the left operand contracted
  on its last dim and the right one on its first. Each operand is put in that layout once
  for all chunks ([B, K, H, S] for v, [B, K, S, H] for k, [B, K, H, G, T] for q and dout),
  and dk, dv come out as [B, K, H, S], so the [T, S] probabilities are never transposed.
  Per-chunk einsums on the [B, T, K, H] inputs made XLA transpose every chunk's keys in
  two layouts, and pad-and-add each chunk's dk and dv.
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
  einsum = functools.partial(cpu_einsum.einsum, preferred_element_type=f32)
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
  """`_laid_out_attention_bwd` for one chunk (all queries against all keys): einsums on the
  inputs' layouts, whose transposes XLA places itself. With nothing sliced, laying the
  operands out by hand only adds copies."""
  q_BTKGH, k_BSKH, v_BSKH, (p_BKGTS,), out_BKGTH = residuals
  f32 = jnp.float32
  dp_BKGTS = cpu_einsum.einsum("bkgth,bskh->bkgts", dout_BKGTH, v_BSKH, preferred_element_type=f32)
  row_dot = _row_dot(dout_BKGTH, out_BKGTH)
  dlogits_BKGTS = p_BKGTS * (dp_BKGTS - row_dot)
  dv = cpu_einsum.einsum("bkgts,bkgth->bskh", p_BKGTS.astype(dout_BKGTH.dtype), dout_BKGTH)
  ds = dlogits_BKGTS.astype(k_BSKH.dtype)
  dq = cpu_einsum.einsum("bkgts,bskh->btkgh", ds, k_BSKH, preferred_element_type=f32) * scale
  dk = cpu_einsum.einsum("bkgts,btkgh->bskh", ds, q_BTKGH, preferred_element_type=f32) * scale
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
  reduce, but over (G, H) when G = 1, so no reshape sits between the reduce and p·(dp − ·),
  which YNNPACK fuses far better.
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


def _by_key_block(parts: list[Array], chunks: Sequence[Chunk], axis: int = -1) -> Array:
  """Σ over chunks of each chunk's gradient for keys [0, key_end) (along `axis`), as one
  array over all keys: each block of keys sums the chunks that saw it (one fusion, no
  padded copies)."""
  blocks, start = [], 0
  for end in sorted({chunk.key_end for chunk in chunks}):
    seen_by = [p for p, c in zip(parts, chunks) if c.key_end >= end]
    windows = [jax.lax.slice_in_dim(p, start, end, axis=axis) for p in seen_by]
    blocks.append(functools.reduce(jnp.add, windows))
    start = end
  return jnp.concatenate(blocks, axis=axis) if len(blocks) > 1 else blocks[0]


# `chunked_attention` in XLA's layouts, laid out as [B, K, G, T, H].
_laid_out_attention = _with_vjp(_laid_out_attention_fwd, _laid_out_attention_bwd)


def chunked_attention(q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes):
  """[B, T, K, G, H] = softmax(q·kᵀ·scale + bias, masked)·v, by query chunks.

  chunks: a `Chunk` per query chunk; masks[i] ([B, 1, T_i, S_i] bool) and biases[i]
  (None or broadcastable to [B, N, T_i, S_i]) describe chunk i's queries against its keys.
  bias_shapes: the biases' shapes (static), None where there is no bias.
  """
  args = (q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes)
  if _in_place_applies(q_BTKGH, k_BSKH, chunks):
    return _in_place_attention(*args)
  return jnp.moveaxis(_laid_out_attention(*args), 3, 1)


def _in_place_applies(q_BTKGH: Array, k_BSKH: Array, chunks: Sequence[Chunk]) -> bool:
  """MKL reads the operands in place: float32 on CPU, and no contraction so small that
  XLA's dot, fused with its neighbours, would do better (`cpu_einsum.MIN_EINSUM_DIM`)."""
  batch, _, heads, groups, head_dim = q_BTKGH.shape
  smallest = min(min(c.end - c.start, c.key_end) for c in chunks)
  flops = 2 * batch * heads * groups * smallest * smallest * head_dim
  return (
      min(smallest, head_dim) >= cpu_einsum.MIN_EINSUM_DIM
      and flops >= cpu_einsum.MIN_EINSUM_FLOPS
      and cpu_einsum.in_place_applies(q_BTKGH, k_BSKH)
  )


def _in_place(equation: str, x: Array, y: Array, chunk: Chunk, x_starts=None, y_starts=None):
  """One of the chunk's contractions over batch (b, k, g) (`cpu_einsum.in_place_einsum`):
  t spans the chunk's queries, s its keys; a start places the chunk in the full operand."""
  sizes = {"t": chunk.end - chunk.start, "s": chunk.key_end}
  return cpu_einsum.in_place_einsum(
      equation, x, y, batch="bkg", sizes=sizes, starts=(x_starts or {}, y_starts or {})
  )


def _in_place_attention_fwd(q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes):
  del bias_shapes  # the backward's
  probabilities, outputs = [], []
  for chunk, mask_B1TS, bias in zip(chunks, masks, biases):
    products_BKGTS = _in_place("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, chunk, {"t": chunk.start})
    p_BKGTS = _probabilities(dense.scaled_logits(products_BKGTS, mask_B1TS, bias, scale), mask_B1TS)
    probabilities.append(p_BKGTS)
    outputs.append(_in_place("bkgts,bskh->btkgh", p_BKGTS, v_BSKH, chunk))
  out_BTKGH = jnp.concatenate(outputs, axis=1) if len(outputs) > 1 else outputs[0]
  return out_BTKGH, (q_BTKGH, k_BSKH, v_BSKH, tuple(probabilities), out_BTKGH)


def _in_place_attention_bwd(scale, chunks, bias_shapes, residuals, dout_BTKGH):
  """`_laid_out_attention_bwd` with every contraction read and written in place: dq comes
  out [B, T_i, K, G, H] per chunk, dk and dv [B, S_i, K, H], the inputs' own layouts."""
  q_BTKGH, k_BSKH, v_BSKH, probabilities, out_BTKGH = residuals
  row_dot_BTKG = jnp.einsum(
      "btkgh,btkgh->btkg", dout_BTKGH, out_BTKGH, precision=jax.lax.Precision.HIGHEST
  )
  row_dot_BKGT1 = row_dot_BTKG.transpose(0, 2, 3, 1)[..., None]
  groups = q_BTKGH.shape[3]

  def per_key(x_BKGTS, y_BTKGH, chunk):
    """Σ over the chunk's queries (and query groups) as [B, S_i, K, H]."""
    part_BSKGH = _in_place("bkgts,btkgh->bskgh", x_BKGTS, y_BTKGH, chunk, {}, {"t": chunk.start})
    return part_BSKGH.sum(3) if groups > 1 else part_BSKGH[:, :, :, 0]

  dq_parts, dk_parts, dv_parts, dbiases = [], [], [], []
  for chunk, p_BKGTS, bias_shape in zip(chunks, probabilities, bias_shapes):
    dp_BKGTS = _in_place("btkgh,bskh->bkgts", dout_BTKGH, v_BSKH, chunk, {"t": chunk.start})
    row_dot_c = row_dot_BKGT1[:, :, :, chunk.start : chunk.end]
    dlogits_BKGTS = p_BKGTS * (dp_BKGTS - row_dot_c)
    dv_parts.append(per_key(p_BKGTS, dout_BTKGH, chunk))
    dq_parts.append(_in_place("bkgts,bskh->btkgh", dlogits_BKGTS, k_BSKH, chunk))
    dk_parts.append(per_key(dlogits_BKGTS, q_BTKGH, chunk))
    dbiases.append(_bias_gradient(dlogits_BKGTS, bias_shape))
  dq = jnp.concatenate(dq_parts, axis=1) if len(dq_parts) > 1 else dq_parts[0]
  dk = _by_key_block(dk_parts, chunks, axis=1)
  dv = _by_key_block(dv_parts, chunks, axis=1)
  return dq * scale, dk * scale, dv, None, tuple(dbiases)


_in_place_attention = _with_vjp(_in_place_attention_fwd, _in_place_attention_bwd)


# Causal self-attention splits its queries into this many chunks, each attending only to
# the keys up to its last query; chunks stay >= MIN_QUERY_CHUNK queries (tuned on 2-core
# x86 CPUs at T = 256, docs/performance.md).
CAUSAL_QUERY_CHUNKS = 4
MIN_QUERY_CHUNK = 64


def causal_chunk_bounds(spec: AttentionSpec, query_chunks: int | None = None) -> list[int]:
  """Query chunk boundaries [0, ..., T]; one chunk unless the keys are the causal queries."""
  length = spec.query_length
  if not (spec.causal and spec.same_tokens and length == spec.key_length):
    return [0, length]
  if query_chunks is None:
    query_chunks = max(1, min(CAUSAL_QUERY_CHUNKS, length // MIN_QUERY_CHUNK))
  query_chunks = min(query_chunks, length)
  return [round(i * length / query_chunks) for i in range(query_chunks + 1)]


def dense_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    spec: AttentionSpec,
    *,
    scale: float,
    query_chunks: int | None = None,
) -> Array:
  """The `dense` backend's result by causal query chunks (`query_chunks`; None: up to
  CAUSAL_QUERY_CHUNKS), without dropout."""
  if spec.explicit_mask is not None:
    return dense.dense_attention(
        q_BTNH, k_BSKH, v_BSKH, spec.mask(), spec.bias_logits(), scale=scale
    )
  bounds = causal_chunk_bounds(spec, query_chunks)
  if len(bounds) == 2:
    chunks, specs = (Chunk(0, spec.query_length, spec.key_length),), [spec]
  else:
    # A chunk's queries see no key after its last query: those keys are left out.
    chunks = tuple(Chunk(start, end, end) for start, end in zip(bounds[:-1], bounds[1:]))
    specs = [spec.queries(c.start, c.end - c.start).keys(0, c.key_end) for c in chunks]
  masks = tuple(s.mask() for s in specs)
  biases = tuple(s.bias_logits() for s in specs)
  bias_shapes = tuple(None if b is None else b.shape for b in biases)
  q_BTKGH = dense.group_queries(q_BTNH, k_BSKH.shape[2])
  out_BTKGH = chunked_attention(q_BTKGH, k_BSKH, v_BSKH, masks, biases, scale, chunks, bias_shapes)
  return out_BTKGH.reshape(q_BTNH.shape)

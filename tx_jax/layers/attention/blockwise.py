"""Memory-efficient attention: an online softmax over key blocks (FlashAttention's algorithm
in plain JAX), with a custom VJP that recomputes each block instead of storing T x S.

Three pieces, kept apart so that ring attention (key blocks arriving from other devices)
can reuse them:

- `attend_block`: one query block against one key block -> a `Partial` (unnormalised
  output, running max, running sum), given the block's `AttentionSpec`;
- `merge`: combines two `Partial`s over disjoint key sets (rescaling by the running max);
- `AttentionSpec` (`attention.spec`): materialises any block's mask and bias from
  segment ids, indices and positions alone.

Blocks whose mask is all False (above the causal diagonal, outside the window, between
different packed segments, padding) are skipped with `lax.cond`, in the forward and the
backward pass. Grouped queries ([B, T, K, G, H]) attend to K/V heads without repeating them.
Lengths that the block sizes do not divide are padded with segment id 0 (masked).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tx_jax.layers import ops
from tx_jax.layers.attention.dense import to_groups
from tx_jax.layers.attention.spec import AttentionSpec

Array = jnp.ndarray

# Query and key block size: each block pays a fixed cost in XLA ops, so larger blocks win
# while their [T, S] tiles stay small (tuned on a 2-core CPU at T = 2k-16k; docs/performance.md).
DEFAULT_BLOCK = 512


class Partial(NamedTuple):
  """Attention over a subset of the keys, not yet normalised.

  out [B, K, G, T, H] = sum_s exp(logit_s - max) v_s, max [B, K, G, T] (-inf where the
  query saw no key yet), sum [B, K, G, T] = sum_s exp(logit_s - max). All float32.
  """

  out: Array
  max: Array
  sum: Array


def block_logits(
    q_BKGTH: Array, k_BKHS: Array, spec: AttentionSpec, scale: float, einsum=ops.einsum
) -> Array:
  """Scaled float32 logits plus bias for one block, [B, K, G, T, S] (unmasked)."""
  logits_BKGTS = einsum(
      "bkgth,bkhs->bkgts", q_BKGTH, k_BKHS, preferred_element_type=jnp.float32
  ) * jnp.float32(scale)
  bias_BNTS = spec.bias_logits()
  if bias_BNTS is not None:
    logits_BKGTS = logits_BKGTS + bias_BNTS.reshape(logits_BKGTS.shape)
  return logits_BKGTS


def block_mask(spec: AttentionSpec, num_kv_heads: int) -> Array:
  """The block's mask as [B, K|1, G|1, T, S], to broadcast over grouped logits."""
  return to_groups(spec.mask(), num_kv_heads)


def attend_block(
    q_BKGTH: Array,
    k_BKHS: Array,
    v_BKSH: Array,
    spec: AttentionSpec,
    scale: float,
    einsum=ops.einsum,
) -> Partial:
  """The per-block kernel: one query block against one key block.

  Operands come laid out once per call by `heads_major` (batch dims leading, the left
  operand contracted on its last dim, the right on its first), so no block is transposed
  inside the loops.
  """
  logits_BKGTS = block_logits(q_BKGTH, k_BKHS, spec, scale, einsum)
  mask_B11TS = block_mask(spec, q_BKGTH.shape[1])
  block_max = jnp.max(jnp.where(mask_B11TS, logits_BKGTS, -jnp.inf), axis=-1)
  shift = jnp.where(jnp.isfinite(block_max), block_max, 0.0)
  p_BKGTS = jnp.where(mask_B11TS, jnp.exp(logits_BKGTS - shift[..., None]), 0.0)
  out_BKGTH = einsum(
      "bkgts,bksh->bkgth",
      p_BKGTS.astype(v_BKSH.dtype),
      v_BKSH,
      preferred_element_type=jnp.float32,
  )
  return Partial(out_BKGTH, block_max, jnp.sum(p_BKGTS, axis=-1))


def heads_major(q_BTKGH: Array, k_BSKH: Array, v_BSKH: Array) -> tuple[Array, Array, Array]:
  """(q [B, K, G, T, H], k [B, K, H, S], v [B, K, S, H]): `attend_block`'s layouts."""
  return (
      q_BTKGH.transpose(0, 2, 3, 1, 4),
      k_BSKH.transpose(0, 2, 3, 1),
      v_BSKH.transpose(0, 2, 1, 3),
  )


def merge(a: Partial, b: Partial) -> Partial:
  """Attention over the union of two disjoint key sets, from each set's Partial."""
  new_max = jnp.maximum(a.max, b.max)
  shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
  # exp(-inf - shift) = 0: a side that saw no key contributes nothing.
  scale_a, scale_b = jnp.exp(a.max - shift), jnp.exp(b.max - shift)
  return Partial(
      a.out * scale_a[..., None] + b.out * scale_b[..., None],
      new_max,
      a.sum * scale_a + b.sum * scale_b,
  )


def empty_partial(batch: int, kv_heads: int, groups: int, length: int, head_dim: int) -> Partial:
  """The Partial of no keys at all (merge's identity)."""
  shape = (batch, kv_heads, groups, length)
  return Partial(
      jnp.zeros(shape + (head_dim,), jnp.float32),
      jnp.full(shape, -jnp.inf, jnp.float32),
      jnp.zeros(shape, jnp.float32),
  )


def finish(p: Partial) -> tuple[Array, Array]:
  """(output [B, K, G, T, H], log-sum-exp [B, K, G, T]); rows that saw no key give 0, -inf."""
  seen = p.sum > 0
  out = p.out / jnp.where(seen, p.sum, 1.0)[..., None]
  lse = jnp.where(seen, p.max + jnp.log(jnp.where(seen, p.sum, 1.0)), -jnp.inf)
  return jnp.where(seen[..., None], out, 0.0), lse


def _blocks(length: int, block: int) -> tuple[int, int]:
  """(block size actually used, number of blocks): short inputs use one short block."""
  block = min(block, length)
  return block, -(-length // block)


def _forward(q_BTKGH, k_BSKH, v_BSKH, spec, scale, block_q, block_k, einsum):
  """Padded inputs -> (out [B, K, G, T, H] f32, lse [B, K, G, T])."""
  batch, length, kv_heads, groups, head_dim = q_BTKGH.shape
  num_q_blocks, num_k_blocks = length // block_q, k_BSKH.shape[1] // block_k
  q_BKGTH, k_BKHS, v_BKSH = heads_major(q_BTKGH, k_BSKH, v_BSKH)

  def query_block(i):
    q_blk = jax.lax.dynamic_slice_in_dim(q_BKGTH, i * block_q, block_q, axis=3)
    spec_i = spec.queries(i * block_q, block_q)

    def key_step(acc: Partial, j):
      spec_ij = spec_i.keys(j * block_k, block_k)
      k_blk = jax.lax.dynamic_slice_in_dim(k_BKHS, j * block_k, block_k, axis=3)
      v_blk = jax.lax.dynamic_slice_in_dim(v_BKSH, j * block_k, block_k, axis=2)
      visible = jnp.any(spec_ij.mask())
      acc = jax.lax.cond(
          visible,
          lambda: merge(acc, attend_block(q_blk, k_blk, v_blk, spec_ij, scale, einsum)),
          lambda: acc,
      )
      return acc, None

    init = empty_partial(batch, kv_heads, groups, block_q, head_dim)
    acc, _ = jax.lax.scan(key_step, init, jnp.arange(num_k_blocks))
    return finish(acc)

  out_QBKGTH, lse_QBKGT = jax.lax.map(query_block, jnp.arange(num_q_blocks))
  # [blocks, B, K, G, block, ...] -> [B, K, G, T, ...]
  out = jnp.moveaxis(out_QBKGTH, 0, 3).reshape(batch, kv_heads, groups, length, head_dim)
  lse = jnp.moveaxis(lse_QBKGT, 0, 3).reshape(batch, kv_heads, groups, length)
  return out, lse


def _backward(q_BTKGH, k_BSKH, v_BSKH, spec, scale, block_q, block_k, einsum, out, lse, dout):
  """Gradients w.r.t. q, k, v and the bias parameters, one recomputed block at a time.

  Every operand is laid out once for the dots it feeds (see `attend_block`); dk and dv are
  accumulated as [B, K, H, block] and dq as [B, K, G, T, H], then transposed back once.
  """
  num_q_blocks, num_k_blocks = q_BTKGH.shape[1] // block_q, k_BSKH.shape[1] // block_k
  dout_BKGTH = dout.astype(jnp.float32)
  delta_BKGT = jnp.sum(dout_BKGTH * out, axis=-1)
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # such rows have no visible key: p = 0 anyway
  take = lambda x, start, size, axis: jax.lax.dynamic_slice_in_dim(x, start, size, axis)  # noqa
  q_BKGTH, k_BKHS, _ = heads_major(q_BTKGH, k_BSKH, v_BSKH)
  q_BKHGT = q_BTKGH.transpose(0, 2, 4, 3, 1)
  k_BKSH = k_BSKH.transpose(0, 2, 1, 3)
  v_BKHS = v_BSKH.transpose(0, 2, 3, 1)
  dout_BKHGT = dout_BKGTH.transpose(0, 1, 4, 2, 3)
  f32 = jnp.float32

  def key_block(carry, j):
    dq, dbias = carry
    k_blk_hs = take(k_BKHS, j * block_k, block_k, 3)
    k_blk_sh = take(k_BKSH, j * block_k, block_k, 2)
    v_blk_hs = take(v_BKHS, j * block_k, block_k, 3)
    spec_j = spec.keys(j * block_k, block_k)

    def query_step(inner, i):
      dk_blk, dv_blk, dq, dbias = inner
      spec_ij = spec_j.queries(i * block_q, block_q)
      mask_B11TS = block_mask(spec_ij, q_BTKGH.shape[2])

      def compute():
        q_blk = take(q_BKGTH, i * block_q, block_q, 3)
        do_blk = take(dout_BKGTH, i * block_q, block_q, 3)
        logits, bias_vjp = jax.vjp(
            lambda bias: block_logits(q_blk, k_blk_hs, spec_ij.replace(bias=bias), scale, einsum),
            spec_ij.bias,
        )
        lse_blk = take(lse, i * block_q, block_q, 3)
        p = jnp.where(mask_B11TS, jnp.exp(logits - lse_blk[..., None]), 0.0)
        do_blk_t = take(dout_BKHGT, i * block_q, block_q, 4)
        dv = einsum("bkhgt,bkgts->bkhs", do_blk_t, p, preferred_element_type=f32)
        dp = einsum("bkgth,bkhs->bkgts", do_blk, v_blk_hs, preferred_element_type=f32)
        ds = p * (dp - take(delta_BKGT, i * block_q, block_q, 3)[..., None])
        dq_blk = einsum("bkgts,bksh->bkgth", ds, k_blk_sh, preferred_element_type=f32)
        q_blk_t = take(q_BKHGT, i * block_q, block_q, 4)
        dk = einsum("bkhgt,bkgts->bkhs", q_blk_t, ds, preferred_element_type=f32)
        (dbias_blk,) = bias_vjp(ds)
        dq_i = take(dq, i * block_q, block_q, 3) + dq_blk * scale
        return (
            dk_blk + dk * scale,
            dv_blk + dv,
            jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * block_q, axis=3),
            jax.tree.map(jnp.add, dbias, dbias_blk),
        )

      return jax.lax.cond(jnp.any(mask_B11TS), compute, lambda: inner), None

    zeros_kv = jnp.zeros(k_blk_hs.shape, jnp.float32)
    (dk_blk, dv_blk, dq, dbias), _ = jax.lax.scan(
        query_step, (zeros_kv, zeros_kv, dq, dbias), jnp.arange(num_q_blocks)
    )
    return (dq, dbias), (dk_blk, dv_blk)

  dbias0 = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), spec.bias)
  dq0 = jnp.zeros(q_BKGTH.shape, jnp.float32)
  (dq, dbias), (dk_blocks, dv_blocks) = jax.lax.scan(
      key_block, (dq0, dbias0), jnp.arange(num_k_blocks)
  )
  # [blocks, B, K, H, block] -> [B, S, K, H]
  batch, length, kv_heads, head_dim = k_BSKH.shape
  unblock = lambda x: x.transpose(1, 0, 4, 2, 3).reshape(  # noqa: E731
      batch, length, kv_heads, head_dim
  )
  return dq.transpose(0, 3, 1, 2, 4), unblock(dk_blocks), unblock(dv_blocks), dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q_BTKGH, k_BSKH, v_BSKH, spec, scale, block_q, block_k, einsum):
  out, _ = _forward(q_BTKGH, k_BSKH, v_BSKH, spec, scale, block_q, block_k, einsum)
  return out


def _attention_fwd(q_BTKGH, k_BSKH, v_BSKH, spec, scale, block_q, block_k, einsum):
  out, lse = _forward(q_BTKGH, k_BSKH, v_BSKH, spec, scale, block_q, block_k, einsum)
  return out, (q_BTKGH, k_BSKH, v_BSKH, spec, out, lse)


def _attention_bwd(scale, block_q, block_k, einsum, residuals, dout):
  q_BTKGH, k_BSKH, v_BSKH, spec, out, lse = residuals
  dq, dk, dv, dbias = _backward(
      q_BTKGH, k_BSKH, v_BSKH, spec, scale, block_q, block_k, einsum, out, lse, dout
  )
  dspec = spec_cotangent(spec, dbias)
  return dq.astype(q_BTKGH.dtype), dk.astype(k_BSKH.dtype), dv.astype(v_BSKH.dtype), dspec


def spec_cotangent(spec: AttentionSpec, dbias) -> AttentionSpec:
  """A spec's cotangent in a custom VJP: dbias for the bias parameters, and float0 zeros for
  the segment ids, indices and positions, which are integers."""
  dspec = jax.tree.map(_zero_cotangent, spec.replace(bias=None))
  if spec.bias is not None:
    dspec = dspec.replace(bias=jax.tree.map(lambda d, x: d.astype(x.dtype), dbias, spec.bias))
  return dspec


def _zero_cotangent(x: Array) -> Array:
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return jnp.zeros(x.shape, jax.dtypes.float0)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    spec: AttentionSpec,
    *,
    scale: float,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
    kernels: ops.Kernels = ops.get(ops.PLAIN),
) -> Array:
  """softmax(Q·Kᵀ·scale + bias)·V over key blocks; never stores a [T, S] matrix.

  Its backward is a custom VJP that recomputes each block: reverse-mode autodiff only.
  """
  del dropout_rng
  if not deterministic and dropout_rate > 0.0:
    raise ValueError(
        "attention backend 'blockwise' has no attention dropout; set "
        f"model.attention_dropout_rate=0 (got {dropout_rate}) or model.attention_backend='dense'"
    )
  batch, length, num_heads, head_dim = q_BTNH.shape
  kv_length, kv_heads = k_BSKH.shape[1], k_BSKH.shape[2]
  block_q, num_q_blocks = _blocks(length, block_q)
  block_k, num_k_blocks = _blocks(kv_length, block_k)
  padded_q, padded_k = block_q * num_q_blocks, block_k * num_k_blocks
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))  # noqa: E731
  q_BTKGH = pad(q_BTNH, padded_q).reshape(
      batch, padded_q, kv_heads, num_heads // kv_heads, head_dim
  )
  out_BKGTH = _attention(
      q_BTKGH,
      pad(k_BSKH, padded_k),
      pad(v_BSKH, padded_k),
      spec.padded(padded_q, padded_k),
      scale,
      block_q,
      block_k,
      kernels.einsum,
  )
  out_BTKGH = jnp.moveaxis(out_BKGTH, 3, 1)[:, :length]
  return out_BTKGH.reshape(batch, length, num_heads, head_dim).astype(q_BTNH.dtype)

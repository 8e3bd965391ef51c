"""The `splash` backend: JAX's TPU splash attention kernel
(`jax.experimental.pallas.ops.tpu.splash_attention`, Mosaic TPU) behind the `AttentionSpec`.

What reaches the kernel: segment ids for padding and packing (`SegmentIds`, O(T)), and a
lazy mask object that the kernel evaluates block by block (causal, a sliding window, or
none), so no [T, S] tensor exists. GQA runs without repeating K and V: the multi-head
kernel maps each query head to its K/V head, and MQA (one K/V head) uses the MQA kernel.
It has no additive bias (T5 relative, ALiBi), no explicit mask and no dropout: those raise
an error naming the backend that has them. Causality and the window are by array position,
so queries must be keys 0..T-1 (not a KV cache).

Lengths are padded to a multiple of 128 (the kernel's lane width) with segment id 0. The
kernel lets a padding query attend to padding keys (0 == 0); those rows are zeroed
afterwards, as in `dense`, which also stops their gradient. On CPU the kernel runs only
with `interpret=True` (TPU interpret mode, for tests).
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import splash_attention as sa
import jax.numpy as jnp

from tx_jax.layers import ops
from tx_jax.layers.attention.spec import AttentionSpec

Array = jnp.ndarray

# The kernel's lane width: block sizes and so padded lengths are multiples of it.
LANES = 128
# Largest block tried first: larger blocks amortise the per-block cost (MaxText's default).
MAX_BLOCK = 512


def _unsupported(what: str, instead: str) -> ValueError:
  return ValueError(
      f"model.attention_backend='splash' (the JAX Pallas TPU splash kernel) does not support "
      f"{what}; use {instead}"
  )


def check_supported(spec: AttentionSpec, dropout_rate: float, deterministic: bool) -> None:
  """Raises a ValueError naming what the splash kernel cannot do, if the spec needs it."""
  if spec.bias is not None:
    raise _unsupported(
        f"an additive bias ({type(spec.bias).__name__}: T5 relative or ALiBi)",
        "'blockwise' or 'dense'",
    )
  if spec.explicit_mask is not None:
    raise _unsupported("an explicit mask (AttentionSpec.explicit_mask)", "'blockwise' or 'dense'")
  if (spec.causal or spec.window is not None) and not spec.same_tokens:
    raise _unsupported(
        "causality or a window over indices other than the array positions 0..T-1 "
        "(a KV cache, key blocks or custom indices)",
        "'blockwise' or 'dense'",
    )
  if not deterministic and dropout_rate > 0.0:
    raise _unsupported(
        f"attention dropout (model.attention_dropout_rate={dropout_rate})",
        "model.attention_dropout_rate=0 or 'dense'",
    )


def _block(length: int) -> int:
  """The largest block up to MAX_BLOCK, a multiple of LANES, that divides `length`."""
  block = MAX_BLOCK
  while length % block:
    block //= 2
  return block


def _mask(spec: AttentionSpec, shape: tuple[int, int]):
  """The kernel's lazy [T, S] mask for the spec's causality and window (not its segments)."""
  if spec.window is not None:
    # The spec's window w keeps |t - s| < w: w - 1 keys on each side (causal: left only).
    left = spec.window - 1
    return sa.LocalMask(shape, window_size=(left, 0 if spec.causal else left), offset=0)
  if spec.causal:
    return sa.CausalMask(shape)
  return sa.FullMask(shape)


def splash_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    spec: AttentionSpec,
    *,
    scale: float,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
    kernels: ops.Kernels | None = None,
    interpret: bool = False,
) -> Array:
  """softmax(Q·Kᵀ·scale)·V with the Pallas TPU splash kernel (forward and backward)."""
  del dropout_rng, kernels
  check_supported(spec, dropout_rate, deterministic)
  if not interpret and jax.default_backend() != "tpu":
    raise ValueError(
        "model.attention_backend='splash' runs the Pallas TPU splash kernel and needs a TPU, "
        f"but JAX runs on {jax.default_backend()!r}; use 'blockwise' or 'dense' there "
        "(tests run the kernel with interpret=True)"
    )
  length, num_heads = q_BTNH.shape[1], q_BTNH.shape[2]
  key_length, kv_heads = k_BSKH.shape[1], k_BSKH.shape[2]
  padded_t, padded_s = -(-length // LANES) * LANES, -(-key_length // LANES) * LANES
  block_q, block_kv = _block(padded_t), _block(padded_s)
  # The kernel takes no scale: q is scaled in float32 before it is cast back.
  q_BTNH = (q_BTNH.astype(jnp.float32) * scale).astype(q_BTNH.dtype)
  # [B, T, N, H] -> [B, N, T_padded, H]: the kernel's layout, one example at a time.
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))  # noqa: E731
  heads_major = lambda x, n: pad(x, n).transpose(0, 2, 1, 3)  # noqa: E731
  q_BNTH = heads_major(q_BTNH, padded_t)
  k_BKSH, v_BKSH = heads_major(k_BSKH, padded_s), heads_major(v_BSKH, padded_s)
  mqa = kv_heads == 1
  if mqa:
    k_BKSH, v_BKSH = k_BKSH[:, 0], v_BKSH[:, 0]
  make = sa.make_splash_mqa if mqa else sa.make_splash_mha
  kernel = make(
      sa.MultiHeadMask([_mask(spec, (padded_t, padded_s))] * num_heads),
      block_sizes=sa.BlockSizes(
          block_q=block_q,
          block_kv=block_kv,
          block_kv_compute=block_kv,
          block_q_dkv=block_q,
          block_kv_dkv=block_kv,
          block_kv_dkv_compute=block_kv,
          block_q_dq=block_q,
          block_kv_dq=block_kv,
      ),
      head_shards=1,
      q_seq_shards=1,
      interpret=pltpu.InterpretParams() if interpret else False,
  )
  pad_ids = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]))).astype(jnp.int32)  # noqa: E731
  segment_ids = sa.SegmentIds(
      q=pad_ids(spec.query_segment_ids, padded_t), kv=pad_ids(spec.key_segment_ids, padded_s)
  )
  # One example per kernel call: the kernel's vmap rule adds a grid axis that TPU interpret
  # mode rejects, and lax.map keeps the TPU's code path the one the tests run.
  out_BNTH = jax.lax.map(
      lambda a: kernel(a[0], a[1], a[2], segment_ids=a[3]), (q_BNTH, k_BKSH, v_BKSH, segment_ids)
  )
  out_BTNH = out_BNTH.transpose(0, 2, 1, 3)[:, :length]
  q_seg, k_seg = spec.query_segment_ids, spec.key_segment_ids
  seen_BT = q_seg != 0
  if not spec.same_tokens:
    # Cross-attention: a query whose segment has no key sees nothing (dense gives 0).
    seen_BT &= jnp.any(q_seg[:, :, None] == k_seg[:, None, :], axis=-1)
  return jnp.where(seen_BT[:, :, None, None], out_BTNH, 0).astype(q_BTNH.dtype)

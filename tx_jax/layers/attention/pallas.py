"""The `pallas` backend: the fused flash-attention kernel that ships with JAX
(`jax.experimental.pallas.ops.gpu.attention.mha`, Triton), behind the `AttentionSpec`
interface.

What that kernel supports, and so what this backend accepts: self-attention over the
whole sequence (query i is key i; one segment-id array for both), causal by index or not,
padding and packing through segment ids, GQA/MQA. K/V heads are repeated to the query
heads here: the Triton kernel's K/V BlockSpec indexes K and V by query head (and its
backward writes dK/dV per query head), so it cannot take fewer; the repeat costs
[B, T, N, H] per K and V, O(T) like Q, never [T, S]. (JAX's Mosaic GPU kernel,
`attention_mgpu`, takes GQA but no segment ids, so it cannot pad or pack.) It has no bias
(T5 relative, ALiBi), no sliding window, no cross-attention, no dropout: those raise an
error naming the backend that does.

Lengths are padded to the block size with segment id 0. The kernel lets a padding query
attend to padding keys (0 == 0); those rows are zeroed afterwards, as in `dense`, which
also stops their gradient. On CPU the kernel runs only with `interpret=True` (tests).
TPU's splash kernel is the `splash` backend (splash.py). jax 0.12.1 removed this kernel:
there the backend raises an error naming the alternatives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tx_jax.layers.attention.spec import AttentionSpec

Array = jnp.ndarray


def _unsupported(what: str, instead: str) -> ValueError:
  return ValueError(
      f"model.attention_backend='pallas' (the JAX Pallas GPU flash kernel) does not support "
      f"{what}; use {instead}"
  )


def _block_size(length: int, block: int) -> int:
  """A power of two (Triton needs one), at least 16, at most `block` and about `length`."""
  size = 16
  while size < min(block, length):
    size *= 2
  return size


def check_supported(spec: AttentionSpec, dropout_rate: float, deterministic: bool) -> None:
  """Raises a ValueError naming what the Pallas kernel cannot do, if the spec needs it."""
  if not spec.same_tokens:
    raise _unsupported(
        "attention whose queries are not its keys (cross-attention, a KV cache, key blocks)",
        "'blockwise' or 'dense'",
    )
  if spec.bias is not None:
    raise _unsupported(
        f"an additive bias ({type(spec.bias).__name__}: T5 relative or ALiBi)",
        "'blockwise' or 'dense'",
    )
  if spec.window is not None:
    raise _unsupported(f"a sliding window (window={spec.window})", "'blockwise' or 'dense'")
  if spec.explicit_mask is not None:
    raise _unsupported("an explicit mask (AttentionSpec.explicit_mask)", "'blockwise' or 'dense'")
  if not deterministic and dropout_rate > 0.0:
    raise _unsupported(
        f"attention dropout (model.attention_dropout_rate={dropout_rate})",
        "model.attention_dropout_rate=0 or 'dense'",
    )


def pallas_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    spec: AttentionSpec,
    *,
    scale: float,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
    block: int = 128,
    interpret: bool = False,
) -> Array:
  """softmax(Q·Kᵀ·scale)·V with the Pallas GPU flash kernel (forward and backward)."""
  del dropout_rng
  check_supported(spec, dropout_rate, deterministic)
  if not interpret and jax.default_backend() != "gpu":
    raise ValueError(
        "model.attention_backend='pallas' runs the Pallas GPU (Triton) kernel and needs a GPU, "
        f"but JAX runs on {jax.default_backend()!r}; use 'blockwise' or 'dense' there "
        "(tests run the kernel with interpret=True)"
    )
  try:
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu
  except ImportError as e:  # jax 0.12.1 removed the Triton attention kernel
    raise ValueError(
        "model.attention_backend='pallas' wraps jax.experimental.pallas.ops.gpu.attention, "
        f"which jax {jax.__version__} does not ship; use 'cudnn' or 'blockwise', or a jax "
        "that has it (jax <= 0.12.0)"
    ) from e

  batch, length, num_heads, head_dim = q_BTNH.shape
  size = _block_size(length, block)
  padded = -(-length // size) * size
  pad = lambda x: jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0)))  # noqa: E731
  groups = num_heads // k_BSKH.shape[2]
  # The kernel indexes K/V by query head (module docstring): repeat them per group.
  k_BTNH = jnp.repeat(pad(k_BSKH), groups, axis=2)
  v_BTNH = jnp.repeat(pad(v_BSKH), groups, axis=2)
  segment_ids_BT = jnp.pad(spec.query_segment_ids, ((0, 0), (0, padded - length)))
  backward = min(size, 32)
  out_BTNH = pallas_gpu.mha(
      pad(q_BTNH),
      k_BTNH,
      v_BTNH,
      segment_ids_BT.astype(jnp.int32),
      sm_scale=scale,
      causal=spec.causal,
      block_sizes=pallas_gpu.BlockSizes(
          block_q=size,
          block_k=size,
          block_q_dkv=backward,
          block_kv_dkv=backward,
          block_q_dq=backward,
          block_kv_dq=backward,
      ),
      interpret=interpret,
  )[:, :length]
  real_BT = spec.query_segment_ids != 0
  return jnp.where(real_BT[:, :, None, None], out_BTNH, 0).astype(q_BTNH.dtype)

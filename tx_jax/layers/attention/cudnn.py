"""The `cudnn` backend: jax.nn.dot_product_attention's fused cuDNN kernel (NVIDIA GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tx_jax.layers import ops
from tx_jax.layers.attention.spec import AttentionSpec

Array = jnp.ndarray

CUDNN_DTYPES = ("bfloat16", "float16")


def no_dropout(backend: str, dropout_rate: float, deterministic: bool) -> None:
  """Raises for attention dropout, which the fused kernels don't implement."""
  if not deterministic and dropout_rate > 0.0:
    raise ValueError(
        f"attention backend {backend!r} has no attention dropout; set "
        f"model.attention_dropout_rate=0 (got {dropout_rate}) or model.attention_backend='dense'"
    )


def unsupported_explicit_mask(backend: str) -> ValueError:
  return ValueError(
      f"attention backend {backend!r} does not take an AttentionSpec.explicit_mask; "
      "use model.attention_backend='dense' or 'blockwise'"
  )


def zero_fully_masked_rows(out_BTNH: Array, mask_B1TS: Array | None) -> Array:
  """A query whose keys are all masked attends to nothing: its output is exactly 0."""
  if mask_B1TS is None:
    return out_BTNH
  any_key_BT = jnp.any(mask_B1TS[:, 0], axis=-1)
  return jnp.where(any_key_BT[:, :, None, None], out_BTNH, 0).astype(out_BTNH.dtype)


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
    kernels: ops.Kernels | None = None,
) -> Array:
  """The `cudnn` backend: jax.nn.dot_product_attention's fused cuDNN kernel (NVIDIA GPU)."""
  del dropout_rng, kernels
  no_dropout("cudnn", dropout_rate, deterministic)
  if spec.explicit_mask is not None:
    raise unsupported_explicit_mask("cudnn")
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
  mask_B1TS = spec.mask()
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
  return zero_fully_masked_rows(out, mask_B1TS)

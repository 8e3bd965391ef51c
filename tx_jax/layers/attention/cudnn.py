"""The `cudnn` backend: jax.nn.dot_product_attention's fused cuDNN kernel (NVIDIA GPU).

What reaches cuDNN is O(T): sequence lengths for padding, `is_causal`, and a left
`local_window_size` for a causal sliding window, never a [T, S] mask (which
jax.nn.dot_product_attention would turn into a [B, 1, T, S] bias). That needs the spec's
static promise `packed=False` (one segment per row, padding only at its end; config
`model.packed_inputs`, which follows `data.pack`). Packed rows are refused with an error
naming 'pallas' (segment ids in the kernel) and 'blockwise': cuDNN's own packed layout
(segment offsets) is not reachable through jax.nn.dot_product_attention, needs a Hopper GPU
and a static bound on segments per row. A bias (T5 relative, ALiBi) is passed as the
[B, N, T, S] tensor cuDNN takes.
"""

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


def check_supported(spec: AttentionSpec) -> None:
  """Raises a ValueError naming what the spec needs that cuDNN cannot take without a mask."""
  if spec.explicit_mask is not None:
    raise unsupported_explicit_mask("cudnn")
  if spec.packed:
    raise ValueError(
        "model.attention_backend='cudnn' takes padding as sequence lengths and needs one "
        "segment per row, but the AttentionSpec is packed=True (config.model.packed_inputs="
        "True, which follows data.pack); use 'pallas' (packed self-attention, GPU) or "
        "'blockwise' for packed rows, or set data.pack=False"
    )
  if spec.causal and not spec.same_tokens:
    raise ValueError(
        "model.attention_backend='cudnn' is causal by array position, but this spec's "
        "queries are not its keys 0..T-1 (a KV cache or custom indices); use 'blockwise' or "
        "'dense'"
    )
  if spec.window is not None and not spec.causal:
    raise ValueError(
        f"model.attention_backend='cudnn' takes only a left (causal) window, but the spec "
        f"has window={spec.window} without causality; use 'blockwise' or 'dense'"
    )


def kernel_arguments(spec: AttentionSpec) -> dict:
  """The O(T) arguments jax.nn.dot_product_attention gets for the spec (no mask)."""
  check_supported(spec)
  arguments = {
      "query_seq_lengths": jnp.sum(spec.query_segment_ids != 0, axis=1, dtype=jnp.int32),
      "key_value_seq_lengths": jnp.sum(spec.key_segment_ids != 0, axis=1, dtype=jnp.int32),
      "is_causal": spec.causal,
  }
  if spec.window is not None:
    # The spec's window w keeps keys t - w < s <= t: w - 1 to the left, none to the right.
    arguments["local_window_size"] = (spec.window - 1, 0)
  return arguments


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
  arguments = kernel_arguments(spec)
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
  batch, length, num_heads, _ = q_BTNH.shape
  key_length = k_BSKH.shape[1]
  bias_BNTS = spec.bias_logits()
  pad_t = pad_s = 0
  if bias_BNTS is not None:
    # cuDNN's training kernels refuse odd lengths with a bias: pad T and S to even (beyond
    # the sequence lengths, so masked; the padded query rows are dropped below).
    pad_t, pad_s = length % 2, key_length % 2
    bias_BNTS = jnp.broadcast_to(bias_BNTS, (batch, num_heads, length, key_length))
    bias_BNTS = jnp.pad(bias_BNTS, ((0, 0), (0, 0), (0, pad_t), (0, pad_s))).astype(q_BTNH.dtype)
  pad_seq = lambda x, n: jnp.pad(x, ((0, 0), (0, n), (0, 0), (0, 0)))  # noqa: E731
  out_BTNH = jax.nn.dot_product_attention(
      pad_seq(q_BTNH, pad_t),
      pad_seq(k_BSKH, pad_s),
      pad_seq(v_BSKH, pad_s),
      bias=bias_BNTS,
      scale=scale,
      implementation="cudnn",
      **arguments,
  )[:, :length]
  # Padding queries, and queries of a row without keys, attend to nothing: exactly 0 (dense).
  seen_BT = (spec.query_segment_ids != 0) & (arguments["key_value_seq_lengths"][:, None] > 0)
  return jnp.where(seen_BT[:, :, None, None], out_BTNH, 0).astype(q_BTNH.dtype)

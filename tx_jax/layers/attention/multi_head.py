"""Multi-head attention: self / cross, grouped-query, RoPE, KV cache, pluggable backends.

The caller describes what may attend to what with an `AttentionSpec` (segment ids,
indices, positions, causal flag, bias parameters, an optional explicit mask); the backend
(`attention.backends`)
materialises the mask and bias it needs and computes softmax(Q·Kᵀ·scale + bias)·V. The
one exception is decoding, where this layer owns the KV cache ("cache" collection) and
always attends with the dense reference (one query step against the cache):

- self-attention appends the new K/V at `cache_index` and attends over all
  cache slots; the caller's spec then describes keys as cache slots [B, S_max].
- a chunked cache (`tx_jax.decode.chunked_cache`) also holds a short "recent"
  buffer: decode steps write there and read the long cache without modifying it,
  and the decode loop flushes recent into the long cache once per chunk.
- cross-attention computes K/V once, on the call that receives the encoder
  output (`kv_BSD`), and reuses them on calls that pass `kv_BSD=None`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tx_jax.layers import axes, ops
from tx_jax.layers.attention.backends import get_backend
from tx_jax.layers.attention.blockwise import DEFAULT_BLOCK
from tx_jax.layers.attention.dense import KeyValuePart, dense_attention, dense_attention_over_parts
from tx_jax.layers.attention.ring import context_parallel_attention, sequence_axis
from tx_jax.layers.attention.spec import AttentionSpec
from tx_jax.layers.linear import Linear, stacked_init
from tx_jax.layers.lora import LoraSpec
from tx_jax.layers.positions import apply_rope

Array = jnp.ndarray


class MultiHeadAttention(nn.Module):
  """softmax(Q·Kᵀ/√d_k)·V over `num_heads` query heads and `num_kv_heads` K/V heads."""

  num_heads: int
  num_kv_heads: int
  head_dim: int
  use_bias: bool = False
  dropout_rate: float = 0.0
  backend: str = "dense"
  scale: float | None = None  # None: 1/sqrt(head_dim); T5 folds it into the init and uses 1.0
  rope_theta: float | None = None  # set to rotate q and k (RoPE)
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
  output_init: nn.initializers.Initializer | None = None
  # Self-attention's projections from stacked kernels: q, k, v from one [D, 3, N, H] ("qkv")
  # when num_kv_heads == num_heads, else q alone and k, v from one [D, 2, K, H] ("kv").
  # Fewer, wider matrix products.
  fused_qkv: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  kernels: str = ops.PLAIN  # which `layers.ops` kernel set projects and attends
  blockwise_blocks: tuple[int, int] = (DEFAULT_BLOCK, DEFAULT_BLOCK)  # `blockwise`: (query, key)
  # Self-attention on a mesh that splits the sequence (ring.py): "ring" or "all_gather"; and
  # whether attention puts tokens in zig-zag order itself, for batches in natural order.
  context_parallel: str = "ring"
  context_reorder: bool = False
  lora: LoraSpec | None = None  # low-rank adapters on the projections its targets name

  def _fused_projection(self, x_BTD: Array, train: bool) -> tuple[Array, Array, Array]:
    """(q [B, T, N, H], k, v [B, T, K, H]) from stacked kernels (`fused_qkv`)."""
    if self.num_kv_heads == self.num_heads:
      qkv = self._stacked_projection(3, self.num_heads, axes.HEADS, "qkv")
      qkv_BT3NH = qkv(x_BTD, train=train)
      return qkv_BT3NH[:, :, 0], qkv_BT3NH[:, :, 1], qkv_BT3NH[:, :, 2]
    q_BTNH = self._projection(self.num_heads, axes.HEADS, "query")(x_BTD, train=train)
    kv = self._stacked_projection(2, self.num_kv_heads, axes.KV_HEADS, "kv")
    kv_BT2KH = kv(x_BTD, train=train)
    return q_BTNH, kv_BT2KH[:, :, 0], kv_BT2KH[:, :, 1]

  def _stacked_projection(self, parts: int, heads: int, head_axis: str, name: str) -> Linear:
    """`parts` projections in one kernel [D, parts, heads, H], each initialised as if alone."""
    return Linear(
        features=(parts, heads, self.head_dim),
        axes=(axes.EMBED, axes.QKV, head_axis, axes.HEAD_DIM),
        use_bias=self.use_bias,
        kernel_init=stacked_init(self.kernel_init, parts),
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernels=self.kernels,
        lora=self.lora,
        name=name,
    )

  def _projection(self, heads: int, head_axis: str, name: str) -> Linear:
    return Linear(
        features=(heads, self.head_dim),
        axes=(axes.EMBED, head_axis, axes.HEAD_DIM),
        use_bias=self.use_bias,
        kernel_init=self.kernel_init,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernels=self.kernels,
        lora=self.lora,
        name=name,
    )

  @nn.compact
  def __call__(
      self,
      x_BTD: Array,
      kv_BSD: Array | None = None,
      *,
      spec: AttentionSpec | None = None,
      query_positions: Array | None = None,
      key_positions: Array | None = None,
      is_cross: bool = False,
      train: bool = False,
      decode: bool = False,
  ) -> Array:
    """x_BTD attends to itself, or to kv_BSD when `is_cross`. Returns [B, T, D].

    `spec` None: every query sees every key.
    """
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"model.num_heads={self.num_heads} must be a multiple of "
          f"model.num_kv_heads={self.num_kv_heads}"
      )
    if self.fused_qkv and is_cross:
      raise ValueError(
          "fused_qkv stacks self-attention's projections; cross-attention projects its keys "
          "and values from the encoder output, so it takes fused_qkv=False"
      )
    if self.fused_qkv:
      q_BTNH, k_BSKH, v_BSKH = self._fused_projection(x_BTD, train)
    else:
      q_BTNH = self._projection(self.num_heads, axes.HEADS, "query")(x_BTD, train=train)
      key_proj = self._projection(self.num_kv_heads, axes.KV_HEADS, "key")
      value_proj = self._projection(self.num_kv_heads, axes.KV_HEADS, "value")
      if is_cross:
        k_BSKH, v_BSKH = self._cross_kv(kv_BSD, key_proj, value_proj, decode, train)
      else:
        k_BSKH, v_BSKH = key_proj(x_BTD, train=train), value_proj(x_BTD, train=train)
    if not is_cross:
      if self.rope_theta is not None:
        q_BTNH = apply_rope(q_BTNH, query_positions, self.rope_theta)
        k_BSKH = apply_rope(k_BSKH, key_positions, self.rope_theta)
      if decode and self.has_variable("cache", "recent_key"):
        out_BTNH = self._attend_chunked_cache(q_BTNH, k_BSKH, v_BSKH, spec)
        return self._output(out_BTNH, x_BTD.shape[-1], train)
      if decode:
        k_BSKH, v_BSKH = self._append_to_cache(k_BSKH, v_BSKH)
    # On a mesh that splits the sequence, self-attention runs context-parallel (ring.py);
    # its keys stay split like the queries, so nothing gathers them first. Decoding gathers.
    context_axis = None if decode or is_cross else sequence_axis()
    if context_axis is not None and spec is not None and spec.explicit_mask is not None:
      context_axis = None  # an explicit [T, S] mask can't travel with key blocks: GSPMD's way
    q_BTNH = axes.constrain(q_BTNH, "BTNH")
    k_BSKH = axes.constrain(k_BSKH, "BTKH" if context_axis else "BSKH")
    v_BSKH = axes.constrain(v_BSKH, "BTKH" if context_axis else "BSKH")

    scale = self.scale if self.scale is not None else self.head_dim**-0.5
    if spec is None:
      spec = AttentionSpec.cross_attention(
          jnp.ones(q_BTNH.shape[:2], jnp.int32), jnp.ones(k_BSKH.shape[:2], jnp.int32), packed=False
      )
    if decode:
      # One step against the cache: the [T, S_max] mask is small, and decoding keeps the
      # dense path whatever the training backend.
      out_BTNH = dense_attention(
          q_BTNH, k_BSKH, v_BSKH, spec.mask(), spec.bias_logits(), scale=scale
      )
      return self._output(out_BTNH, x_BTD.shape[-1], train)
    deterministic = not train or self.dropout_rate == 0.0
    if context_axis is not None:
      if not deterministic:
        raise ValueError(
            f"context-parallel attention (mesh sequence axis {context_axis!r} > 1) has no "
            f"attention dropout; set model.attention_dropout_rate=0 (got {self.dropout_rate})"
        )
      out_BTNH = context_parallel_attention(
          q_BTNH,
          k_BSKH,
          v_BSKH,
          spec,
          scale=scale,
          axis_name=context_axis,
          variant=self.context_parallel,
          reorder=self.context_reorder,
          kernels=ops.get(self.kernels),
      )
      return self._output(out_BTNH, x_BTD.shape[-1], train)
    block_q, block_k = self.blockwise_blocks
    out_BTNH = get_backend(self.backend, block_q=block_q, block_k=block_k)(
        q_BTNH,
        k_BSKH,
        v_BSKH,
        spec,
        scale=scale,
        dropout_rate=self.dropout_rate,
        dropout_rng=None if deterministic else self.make_rng("dropout"),
        deterministic=deterministic,
        kernels=ops.get(self.kernels),
    )
    return self._output(out_BTNH, x_BTD.shape[-1], train)

  def _output(self, out_BTNH: Array, features: int, train: bool) -> Array:
    """The output projection [B, T, N, H] -> [B, T, features]."""
    out_BTNH = axes.constrain(out_BTNH, "BTNH")
    return Linear(
        features=features,
        axes=(axes.HEADS, axes.HEAD_DIM, axes.EMBED),
        in_dims=2,
        use_bias=self.use_bias,
        kernel_init=self.output_init or self.kernel_init,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernels=self.kernels,
        lora=self.lora,
        name="out",
    )(out_BTNH, train=train)

  def _append_to_cache(self, k_BTKH: Array, v_BTKH: Array) -> tuple[Array, Array]:
    """Writes the new K/V at cache_index; returns the whole cache as [B, S_max, K, H].

    The cache is stored [B, K, S_max, H], the layout the attention product reads, so a
    decode step does not transpose the whole cache (which made a step's cost grow with
    the cache length). On the call that creates the cache (init with a full-length
    input) the new K/V are returned as they are and nothing is written.
    """
    to_stored = lambda x: jnp.swapaxes(x, 1, 2)  # [B,T,K,H] <-> [B,K,T,H]
    initialized = self.has_variable("cache", "cached_key")
    stored_shape = to_stored(k_BTKH).shape
    cached_key = self.variable("cache", "cached_key", jnp.zeros, stored_shape, k_BTKH.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, stored_shape, v_BTKH.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialized:
      return k_BTKH, v_BTKH
    index = cache_index.value
    start = (0, 0, index, 0)
    cached_key.value = jax.lax.dynamic_update_slice(
        cached_key.value, to_stored(k_BTKH).astype(cached_key.value.dtype), start
    )
    cached_value.value = jax.lax.dynamic_update_slice(
        cached_value.value, to_stored(v_BTKH).astype(cached_value.value.dtype), start
    )
    cache_index.value = index + k_BTKH.shape[1]
    return to_stored(cached_key.value), to_stored(cached_value.value)

  def _attend_chunked_cache(
      self, q_BTNH: Array, k_BTKH: Array, v_BTKH: Array, spec: AttentionSpec | None
  ) -> Array:
    """A decode step on a chunked cache: new K/V go to the recent buffer, the long cache is
    only read.

    Slots below `flushed_index` live in the long cache (`cached_key`), slots from it on in
    `recent_key` (recent slot j = cache slot flushed_index + j), so the step's writes touch
    a [B, K, C, H] buffer and XLA need not copy the long cache to update it in place
    inside the decode loop. The spec's mask and bias over all S_max slots are split the
    same way; one softmax covers both parts.
    """
    if spec is None:
      raise ValueError("a chunked-cache decode step needs the spec of its cache slots")
    mask_B1TS, bias = spec.mask(), spec.bias_logits()
    to_stored = lambda x: jnp.swapaxes(x, 1, 2)  # [B,T,K,H] <-> [B,K,T,H]
    cache_index = self.variable("cache", "cache_index")
    flushed_index = self.get_variable("cache", "flushed_index")
    recent_key = self.variable("cache", "recent_key")
    recent_value = self.variable("cache", "recent_value")
    start = (0, 0, cache_index.value - flushed_index, 0)
    recent_key.value = jax.lax.dynamic_update_slice(
        recent_key.value, to_stored(k_BTKH).astype(recent_key.value.dtype), start
    )
    recent_value.value = jax.lax.dynamic_update_slice(
        recent_value.value, to_stored(v_BTKH).astype(recent_value.value.dtype), start
    )
    cache_index.value = cache_index.value + k_BTKH.shape[1]

    chunk = recent_key.value.shape[2]
    long_slots = mask_B1TS.shape[-1]
    recent = lambda x: jax.lax.dynamic_slice_in_dim(x, flushed_index, chunk, axis=3)  # noqa: E731
    long_part = KeyValuePart(
        to_stored(self.get_variable("cache", "cached_key")),
        to_stored(self.get_variable("cache", "cached_value")),
        mask_B1TS & (jnp.arange(long_slots) < flushed_index),
        bias,
    )
    recent_part = KeyValuePart(
        to_stored(recent_key.value),
        to_stored(recent_value.value),
        recent(mask_B1TS),
        None if bias is None else recent(bias),
    )
    return dense_attention_over_parts(
        q_BTNH,
        (long_part, recent_part),
        scale=self.scale if self.scale is not None else self.head_dim**-0.5,
    )

  def _cross_kv(
      self, kv_BSD: Array | None, key_proj, value_proj, decode: bool, train: bool
  ) -> tuple[Array, Array]:
    """Cross-attention K/V: projected from kv_BSD, cached in decode mode when given."""
    if not decode:
      return key_proj(kv_BSD, train=train), value_proj(kv_BSD, train=train)
    if kv_BSD is None:
      if not self.has_variable("cache", "cross_key"):
        raise ValueError(
            "cross-attention decode step before the prefill call: pass the "
            "encoder output on the first decode call"
        )
      return (self.get_variable("cache", "cross_key"), self.get_variable("cache", "cross_value"))
    k_BSKH, v_BSKH = key_proj(kv_BSD), value_proj(kv_BSD)
    self.put_variable("cache", "cross_key", k_BSKH)
    self.put_variable("cache", "cross_value", v_BSKH)
    return k_BSKH, v_BSKH

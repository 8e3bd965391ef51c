"""Pieces every model family shares: input embedding, the attention descriptions
(`AttentionSpec`: segments, causality, bias parameters; training and cached decoding), and
the output projection.

Helpers that create submodules are called from inside a family's compact
method, so the submodules belong to that family's module.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from tx_jax.layers import axes
from tx_jax.layers.attention import AttentionSpec
from tx_jax.layers.block import TransformerStack
from tx_jax.layers.embed import Embed
from tx_jax.layers.linear import Linear
from tx_jax.layers.positions import (
    LearnedPositions,
    RelativePositionBias,
    alibi,
    sinusoidal_embedding,
)
from tx_jax.models.config import ModelConfig

Array = jnp.ndarray


def default_positions(ids_BT: Array) -> Array:
  return jnp.broadcast_to(jnp.arange(ids_BT.shape[1], dtype=jnp.int32), ids_BT.shape)


def default_segment_ids(ids_BT: Array) -> Array:
  return jnp.ones(ids_BT.shape, jnp.int32)


def token_embed(config: ModelConfig, name: str = "token_embed") -> Embed:
  return Embed(
      config.vocab_size,
      config.d_model,
      embedding_init=config.kernel_init()
      if config.init == "normal"
      else nn.initializers.normal(config.d_model**-0.5),
      dtype=config.compute_dtype,
      param_dtype=config.storage_dtype,
      kernels=config.kernels,
      name=name,
  )


def position_embed(config: ModelConfig, name: str) -> LearnedPositions | None:
  """The learned absolute position table, when the config uses one."""
  if config.positions != "learned":
    return None
  return LearnedPositions(
      config.max_len,
      config.d_model,
      embedding_init=config.kernel_init(),
      dtype=config.compute_dtype,
      param_dtype=config.storage_dtype,
      name=name,
  )


def embed_inputs(
    config: ModelConfig,
    embed: Embed,
    positions_table: LearnedPositions | None,
    ids_BT: Array,
    positions_BT: Array,
) -> Array:
  """Token embedding (×√d_model if configured) plus absolute positions, if any."""
  x_BTD = embed(ids_BT)
  if config.embed_scale:
    x_BTD = x_BTD * jnp.asarray(config.d_model**0.5, x_BTD.dtype)
  if positions_table is not None:
    x_BTD = x_BTD + positions_table(positions_BT)
  elif config.positions == "sinusoidal":
    x_BTD = x_BTD + sinusoidal_embedding(positions_BT, config.d_model).astype(x_BTD.dtype)
  return x_BTD


class DecodeSlots(nn.Module):
  """Decoding bookkeeping for one stack: the next free cache slot and each slot's segment id.

  Self-attention masks and relative biases during cached decoding are
  functions of cache slots: prompts are left-padded, so within a row the
  slot difference equals the position difference.
  """

  @nn.compact
  def __call__(self, segment_ids_BT: Array) -> tuple[Array, Array, Array, Array]:
    """Returns (query_slots_BT, key_slots_BS, query_segments_BT, key_segments_BS)."""
    initialized = self.has_variable("cache", "segment_ids")
    slot_segments = self.variable(
        "cache", "segment_ids", jnp.zeros, segment_ids_BT.shape, jnp.int32
    )
    index = self.variable("cache", "index", lambda: jnp.array(0, jnp.int32))
    batch, length = segment_ids_BT.shape
    if not initialized:
      slots_BT = default_positions(segment_ids_BT)
      return slots_BT, slots_BT, segment_ids_BT, segment_ids_BT
    start = index.value
    slot_segments.value = lax.dynamic_update_slice(
        slot_segments.value, segment_ids_BT.astype(jnp.int32), (0, start)
    )
    index.value = start + length
    query_slots_BT = jnp.broadcast_to(start + jnp.arange(length, dtype=jnp.int32), (batch, length))
    key_slots_BS = default_positions(slot_segments.value)
    return query_slots_BT, key_slots_BS, segment_ids_BT, slot_segments.value


def self_attention_spec(
    config: ModelConfig,
    segment_ids_BT: Array,
    positions_BT: Array,
    *,
    causal: bool,
    decode_slots: DecodeSlots | None,
    relative_bias: RelativePositionBias | None,
    token_index_BT: Array | None = None,
) -> AttentionSpec:
  """What may attend to what in a stack's self-attention; no [T, S] tensor is built here.

  Pass `decode_slots` when decoding with the KV cache, None otherwise. `token_index_BT`: each
  token's index in its natural row when the batch arrives reordered (data/context_order.py);
  None means the row is in natural order.
  """
  bias = None
  if config.positions == "relative":
    bias = relative_bias()
  elif config.positions == "alibi":
    bias = alibi(config.num_heads)
  if decode_slots is None:
    # Causality by index, not position: positions restart inside packed rows.
    return AttentionSpec.self_attention(
        segment_ids_BT,
        positions_BT,
        causal=causal,
        bias=bias,
        index_BT=token_index_BT,
        packed=config.packed_inputs,
    )
  # Keys are cache slots; within a row slot differences are position differences.
  query_slots, key_slots, query_seg, key_seg = decode_slots(segment_ids_BT)
  return AttentionSpec(
      query_seg, key_seg, query_slots, key_slots, query_slots, key_slots, bias=bias, causal=causal
  )


def relative_bias_module(
    config: ModelConfig, *, bidirectional: bool, name: str
) -> RelativePositionBias | None:
  if config.positions != "relative":
    return None
  return RelativePositionBias(
      num_heads=config.num_heads,
      num_buckets=config.relative_buckets,
      max_distance=config.relative_max_distance,
      bidirectional=bidirectional,
      embedding_init=config.kernel_init(),
      dtype=config.compute_dtype,
      param_dtype=config.storage_dtype,
      name=name,
  )


def transformer_stack(
    config: ModelConfig, name: str, *, decoder: bool = False
) -> TransformerStack:
  """A family's layer stack; `decoder` is the cross-attending stack of an encoder-decoder."""
  return TransformerStack(
      config.layer_spec(cross_attention=decoder),
      config.num_decoder_layers if decoder else config.num_layers,
      scan_layers=config.scan_layers,
      remat_policy=config.remat_policy,
      name=name,
  )


def lm_head(config: ModelConfig, name: str = "lm_head") -> Linear | None:
  """The untied output projection [embed, vocab], or None when the embedding is tied."""
  if config.tie_embeddings:
    return None
  return Linear(
      config.vocab_size,
      (axes.EMBED, axes.VOCAB),
      kernel_init=config.kernel_init(),
      dtype=config.compute_dtype,
      param_dtype=config.storage_dtype,
      kernels=config.kernels,
      lora=config.lora if config.lora.enabled else None,
      name=name,
  )


def output_logits(
    config: ModelConfig, embed: Embed, head: Linear | None, x_BTD: Array, train: bool = False
) -> Array:
  """Vocabulary logits in float32: tied (embed.attend, with T5's optional rescale) or a head."""
  if head is None:
    if config.tied_output_rescale:
      x_BTD = x_BTD * jnp.asarray(config.d_model**-0.5, x_BTD.dtype)
    return embed.attend(x_BTD)
  return head(x_BTD, train=train).astype(jnp.float32)

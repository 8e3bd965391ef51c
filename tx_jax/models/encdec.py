"""Encoder-decoder models: the original Transformer (post-LN, sinusoidal, shared
embeddings scaled by √d_model) and T5 v1.0 / v1.1 (pre-RMSNorm, relative bias)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tx_jax.layers import axes
from tx_jax.layers.attention import AttentionSpec
from tx_jax.layers.norms import make_norm
from tx_jax.models import common
from tx_jax.models.config import ModelConfig

Array = jnp.ndarray


class EncoderDecoder(nn.Module):
  """`encode()` the source once, `decode()` targets against it; `__call__` does both."""

  config: ModelConfig

  def setup(self):
    c = self.config
    self.shared_embed = common.token_embed(c, name="shared_embed")
    self.encoder_relative_bias = common.relative_bias_module(
        c, bidirectional=True, name="encoder_relative_bias"
    )
    self.decoder_relative_bias = common.relative_bias_module(
        c, bidirectional=False, name="decoder_relative_bias"
    )
    self.encoder = common.transformer_stack(c, "encoder")
    self.decoder = common.transformer_stack(c, "decoder", decoder=True)
    if c.pre_norm:
      self.encoder_final_norm = make_norm(c.norm_spec(), "encoder_final_norm")
      self.decoder_final_norm = make_norm(c.norm_spec(), "decoder_final_norm")
    self.encoder_position_embed = common.position_embed(c, "encoder_position_embed")
    self.decoder_position_embed = common.position_embed(c, "decoder_position_embed")
    self.decode_slots = common.DecodeSlots()
    self.lm_head = common.lm_head(c)
    self.dropout = nn.Dropout(c.dropout_rate)

  def encode(
      self,
      encoder_inputs: Array,
      *,
      encoder_segment_ids: Array | None = None,
      encoder_positions: Array | None = None,
      train: bool = False,
  ) -> Array:
    """Source ids [B,S] -> encoded_BSD."""
    c = self.config
    segment_ids = (
        common.default_segment_ids(encoder_inputs)
        if encoder_segment_ids is None
        else encoder_segment_ids
    )
    positions = (
        common.default_positions(encoder_inputs) if encoder_positions is None else encoder_positions
    )
    x_BSD = common.embed_inputs(
        c, self.shared_embed, self.encoder_position_embed, encoder_inputs, positions
    )
    x_BSD = self.dropout(x_BSD, deterministic=not train)
    spec = common.self_attention_spec(
        c,
        segment_ids,
        positions,
        causal=False,
        decode_slots=None,
        relative_bias=self.encoder_relative_bias,
    )
    x_BSD = self.encoder(x_BSD, self_spec=spec, positions_BT=positions, train=train)
    if c.pre_norm:
      x_BSD = self.encoder_final_norm(x_BSD)
    return self.dropout(x_BSD, deterministic=not train)

  def decode(
      self,
      encoded: Array | None,
      decoder_inputs: Array,
      *,
      encoder_segment_ids: Array | None = None,
      decoder_segment_ids: Array | None = None,
      decoder_positions: Array | None = None,
      decoder_token_index: Array | None = None,
      train: bool = False,
      decode: bool = False,
  ) -> Array:
    """Target ids [B,T] attending to `encoded` -> logits_BTV (float32).

    With decode=True, pass `encoded` on the first (prefill) call only; its
    cross-attention K/V and padding are cached and reused afterwards.
    `decoder_token_index`: each target's index in its natural row, for rows that arrive
    reordered (causal load balance, tx_jax/data/context_order.py).
    """
    c = self.config
    segment_ids = (
        common.default_segment_ids(decoder_inputs)
        if decoder_segment_ids is None
        else decoder_segment_ids
    )
    positions = decoder_positions
    if positions is None:
      positions = (
          common.default_positions(decoder_inputs)
          if decoder_token_index is None
          else decoder_token_index
      )
    encoder_segments = self._encoder_segments(encoded, encoder_segment_ids, decode)
    x_BTD = common.embed_inputs(
        c, self.shared_embed, self.decoder_position_embed, decoder_inputs, positions
    )
    x_BTD = self.dropout(x_BTD, deterministic=not train)
    self_spec = common.self_attention_spec(
        c,
        segment_ids,
        positions,
        causal=True,
        decode_slots=self.decode_slots if decode else None,
        relative_bias=self.decoder_relative_bias,
        token_index_BT=decoder_token_index,
    )
    if decode:  # padding only: decoder steps carry segment 1, whatever the encoder's ids
      cross_spec = AttentionSpec.cross_attention(
          (segment_ids != 0).astype(jnp.int32), (encoder_segments != 0).astype(jnp.int32)
      )
    else:
      cross_spec = AttentionSpec.cross_attention(
          segment_ids, encoder_segments, packed=c.packed_inputs
      )
    x_BTD = self.decoder(
        x_BTD,
        encoded_BSD=encoded,
        self_spec=self_spec,
        cross_spec=cross_spec,
        positions_BT=positions,
        train=train,
        decode=decode,
    )
    if c.pre_norm:
      x_BTD = self.decoder_final_norm(x_BTD)
    x_BTD = self.dropout(x_BTD, deterministic=not train)
    logits_BTV = common.output_logits(c, self.shared_embed, self.lm_head, x_BTD, train)
    return axes.constrain(logits_BTV, "BTV")

  def _encoder_segments(
      self, encoded: Array | None, encoder_segment_ids: Array | None, decode: bool
  ) -> Array:
    """Encoder segment ids; while decoding they are cached with the cross K/V."""
    if encoded is not None and encoder_segment_ids is None:
      encoder_segment_ids = jnp.ones(encoded.shape[:2], jnp.int32)
    if not decode:
      return encoder_segment_ids
    if encoded is not None:
      self.put_variable("cache", "encoder_segment_ids", encoder_segment_ids)
      return encoder_segment_ids
    if not self.has_variable("cache", "encoder_segment_ids"):
      raise ValueError(
          "decode step before the prefill call: pass the encoder output " "on the first decode call"
      )
    return self.get_variable("cache", "encoder_segment_ids")

  def __call__(
      self,
      encoder_inputs: Array,
      decoder_inputs: Array,
      *,
      encoder_segment_ids: Array | None = None,
      decoder_segment_ids: Array | None = None,
      encoder_positions: Array | None = None,
      decoder_positions: Array | None = None,
      decoder_token_index: Array | None = None,
      train: bool = False,
      decode: bool = False,
  ) -> Array:
    encoded = self.encode(
        encoder_inputs,
        encoder_segment_ids=encoder_segment_ids,
        encoder_positions=encoder_positions,
        train=train,
    )
    return self.decode(
        encoded,
        decoder_inputs,
        encoder_segment_ids=encoder_segment_ids,
        decoder_segment_ids=decoder_segment_ids,
        decoder_positions=decoder_positions,
        decoder_token_index=decoder_token_index,
        train=train,
        decode=decode,
    )

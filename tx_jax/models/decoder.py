"""Decoder-only language models: GPT-2 and LLaMA-style (RoPE, RMSNorm, SwiGLU, GQA)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tx_jax.layers import axes
from tx_jax.layers.norms import make_norm
from tx_jax.models import common
from tx_jax.models.config import ModelConfig

Array = jnp.ndarray


class Decoder(nn.Module):
  """Causal LM: embeddings -> causal Transformer stack -> [final norm] -> logits_BTV (float32)."""

  config: ModelConfig

  @nn.compact
  def __call__(
      self,
      inputs_BT: Array,
      *,
      segment_ids: Array | None = None,
      positions: Array | None = None,
      token_index: Array | None = None,
      train: bool = False,
      decode: bool = False,
  ) -> Array:
    """`token_index`: each token's index in its natural row, for rows that arrive reordered
    (causal load balance, tx_jax/data/context_order.py); pass positions with it."""
    c = self.config
    segment_ids = common.default_segment_ids(inputs_BT) if segment_ids is None else segment_ids
    if positions is None:
      positions = common.default_positions(inputs_BT) if token_index is None else token_index
    embed = common.token_embed(c)
    x_BTD = common.embed_inputs(
        c, embed, common.position_embed(c, "position_embed"), inputs_BT, positions
    )
    x_BTD = nn.Dropout(c.dropout_rate)(x_BTD, deterministic=not train)
    x_BTD = axes.constrain(x_BTD, "BTD")
    spec = common.self_attention_spec(
        c,
        segment_ids,
        positions,
        causal=True,
        decode_slots=common.DecodeSlots(name="decode_slots") if decode else None,
        relative_bias=common.relative_bias_module(c, bidirectional=False, name="relative_bias"),
        token_index_BT=token_index,
    )
    stack = common.transformer_stack(c, "stack")
    x_BTD = stack(x_BTD, self_spec=spec, positions_BT=positions, train=train, decode=decode)
    if c.pre_norm:
      x_BTD = make_norm(c.norm_spec(), "final_norm")(x_BTD)
    logits_BTV = common.output_logits(c, embed, common.lm_head(c), x_BTD, train)
    return axes.constrain(logits_BTV, "BTV")

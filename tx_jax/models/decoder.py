"""Decoder-only language models: GPT-2 and LLaMA-style (RoPE, RMSNorm, SwiGLU, GQA)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tx_jax.layers.block import TransformerStack
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
      train: bool = False,
      decode: bool = False,
  ) -> Array:
    c = self.config
    segment_ids = common.default_segment_ids(inputs_BT) if segment_ids is None else segment_ids
    positions = common.default_positions(inputs_BT) if positions is None else positions
    embed = common.token_embed(c)
    x_BTD = common.embed_inputs(
        c, embed, common.position_embed(c, "position_embed"), inputs_BT, positions
    )
    x_BTD = nn.Dropout(c.dropout_rate)(x_BTD, deterministic=not train)
    x_BTD = nn.with_logical_constraint(x_BTD, ("act_batch", "act_len", "act_embed"))
    spec = common.self_attention_spec(
        c,
        segment_ids,
        positions,
        causal=True,
        decode_slots=common.DecodeSlots(name="decode_slots") if decode else None,
        relative_bias=common.relative_bias_module(c, bidirectional=False, name="relative_bias"),
    )
    x_BTD = TransformerStack(
        c.layer_spec(),
        c.num_layers,
        scan_layers=c.scan_layers,
        remat_policy=c.remat_policy,
        name="stack",
    )(x_BTD, self_spec=spec, positions_BT=positions, train=train, decode=decode)
    if c.pre_norm:
      x_BTD = make_norm(
          c.norm,
          eps=c.norm_eps,
          use_bias=c.norm_bias,
          dtype=c.compute_dtype,
          param_dtype=c.storage_dtype,
          name="final_norm",
      )(x_BTD)
    logits_BTV = common.output_logits(c, embed, common.lm_head(c), x_BTD)
    return nn.with_logical_constraint(logits_BTV, ("act_batch", "act_len", "act_vocab"))

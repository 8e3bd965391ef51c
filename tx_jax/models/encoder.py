"""BERT-style encoder with a pooler, an MLM head and a classification head."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tx_jax.layers import axes
from tx_jax.layers.embed import Embed
from tx_jax.layers.linear import Linear
from tx_jax.layers.mlp import get_activation
from tx_jax.layers.norms import make_norm
from tx_jax.models import common
from tx_jax.models.config import ModelConfig

Array = jnp.ndarray


class Encoder(nn.Module):
  """Bidirectional encoder. Returns, by `config.head`:

  "none": (sequence_BTD, pooled_BD or None); "mlm": logits_BTV;
  "classification": logits_BC. Logits are float32.
  """

  config: ModelConfig

  @nn.compact
  def __call__(
      self,
      inputs_BT: Array,
      *,
      token_type_ids: Array | None = None,
      segment_ids: Array | None = None,
      positions: Array | None = None,
      train: bool = False,
  ):
    c = self.config
    segment_ids = common.default_segment_ids(inputs_BT) if segment_ids is None else segment_ids
    positions = common.default_positions(inputs_BT) if positions is None else positions
    embed = common.token_embed(c)
    x_BTD = common.embed_inputs(
        c, embed, common.position_embed(c, "position_embed"), inputs_BT, positions
    )
    if c.type_vocab_size:
      token_type_ids = jnp.zeros_like(inputs_BT) if token_type_ids is None else token_type_ids
      x_BTD = x_BTD + Embed(
          c.type_vocab_size,
          c.d_model,
          axes=(axes.TYPE_VOCAB, axes.EMBED),
          embedding_init=c.kernel_init(),
          dtype=c.compute_dtype,
          param_dtype=c.storage_dtype,
          name="type_embed",
      )(token_type_ids)
    if c.embed_norm:
      x_BTD = make_norm(c.norm_spec(), "embed_norm")(x_BTD)
    x_BTD = nn.Dropout(c.dropout_rate)(x_BTD, deterministic=not train)
    x_BTD = axes.constrain(x_BTD, "BTD")
    spec = common.self_attention_spec(
        c,
        segment_ids,
        positions,
        causal=False,
        decode_slots=None,
        relative_bias=common.relative_bias_module(c, bidirectional=True, name="relative_bias"),
    )
    stack = common.transformer_stack(c, "stack")
    x_BTD = stack(x_BTD, self_spec=spec, positions_BT=positions, train=train)
    if c.pre_norm:
      x_BTD = make_norm(c.norm_spec(), "final_norm")(x_BTD)
    pooled_BD = None
    if c.pooler:
      pooled_BD = jnp.tanh(self._dense(c.d_model, (axes.EMBED, axes.MLP), "pooler")(x_BTD[:, 0]))
    if c.head == "mlm":
      h_BTD = get_activation(c.mlp_activation)(
          self._dense(c.d_model, (axes.EMBED, axes.MLP), "mlm_transform")(x_BTD)
      )
      h_BTD = make_norm(c.norm_spec(), "mlm_norm")(h_BTD)
      # Pin the layout before the tied projection: left to itself, XLA's SPMD
      # partitioner produced wrong gradients here on a (2,2,2) data/fsdp/tensor mesh.
      h_BTD = axes.constrain(h_BTD, "BTD")
      output_bias = self.param(
          "mlm_bias",
          nn.with_logical_partitioning(nn.initializers.zeros, (axes.VOCAB,)),
          (c.vocab_size,),
          c.storage_dtype,
      )
      return embed.attend(h_BTD) + output_bias.astype(jnp.float32)
    if c.head == "classification":
      if pooled_BD is None:
        raise ValueError("config.model.head='classification' needs " "config.model.pooler=True")
      pooled_BD = nn.Dropout(c.dropout_rate)(pooled_BD, deterministic=not train)
      logits = self._dense(c.num_classes, (axes.EMBED, None), "classifier")(pooled_BD)
      return logits.astype(jnp.float32)
    return x_BTD, pooled_BD

  def _dense(self, features: int, kernel_axes: tuple[str | None, str | None], name: str) -> Linear:
    c = self.config
    return Linear(
        features,
        kernel_axes,
        use_bias=True,
        kernel_init=c.kernel_init(),
        dtype=c.compute_dtype,
        param_dtype=c.storage_dtype,
        kernels=c.kernels,
        name=name,
    )
